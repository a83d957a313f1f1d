"""One contract for the programs baton launches: a typed spec file in (tasks/events.py ProgramSpec), never flags with
defaults of their own. The serve supervisor's `--restarts` once defaulted to 0 where serve.restarts says 2, and the
health timeout's 600 s was written three times; a spec model with no defaults cannot drift from the config."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, TINY
from tasks import events
from tasks.distributed import Launch

pytestmark = pytest.mark.fast
FOLDERS = ("tasks", "conversions")
SUPERVISOR = REPO / "tasks/serve/supervisor.py"
WORKERS = {stage: REPO / "tasks" / stage / "worker.py" for stage in ("pretrain", "rlhf", "finetune", "convert")}
DISTRIBUTED = {name: REPO / "tasks/distributed" / f"{name}.py" for name in ("node", "slurm", "ray_driver")}


def launched_programs() -> list:
    """Every module under tasks/ and conversions/ that runs as a program of its own (`if __name__ == "__main__"`)."""
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py")
                  if '__name__ == "__main__"' in p.read_text())


def parsers_in(path) -> list[int]:
    """Lines that build a command-line parser of their own (argparse.ArgumentParser or ArgumentParser)."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) == "ArgumentParser"]


def test_no_launched_program_parses_flags_of_its_own():
    programs = launched_programs()
    assert REPO / "tasks/serve/supervisor.py" in programs and REPO / "tasks/serve/lm_eval_worker.py" in programs
    own = {str(p.relative_to(REPO)): lines for p in programs if (lines := parsers_in(p))}
    assert own == {}, f"these programs take flags with defaults of their own, not a spec (tasks/events.py): {own}"


def test_the_scan_finds_a_parser(tmp_path):
    planted = tmp_path / "worker.py"
    planted.write_text("import argparse\nap = argparse.ArgumentParser()\nap.add_argument('--restarts', default=0)\n")
    assert parsers_in(planted) == [2]


def calls_named(path, *names: str) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", getattr(n.func, "id", None)) in names]


def spec_models_read(path) -> list[str]:
    """The models a program hands events.read_typed_spec (`events.RlhfSpec` → 'RlhfSpec')."""
    return [getattr(c.args[0], "attr", getattr(c.args[0], "id", "?")) for c in calls_named(path, "read_typed_spec")]


def untyped_spec_reads(path) -> list[int]:
    """Lines that read a spec without its model: a dict reader (read_spec) or an argparse.Namespace built from one."""
    return [c.lineno for c in calls_named(path, "read_spec", "Namespace")]


def test_every_program_given_a_spec_reads_it_through_its_model():
    """A program launched with `--spec` validates the whole file against one ProgramSpec before it does anything; a
    dict spec (the rlhf worker's SPEC_KEYS and Namespace, pretrain's nested dump) checked nothing but key names."""
    given_a_spec = [p for p in launched_programs() if "--spec" in p.read_text()]
    assert set(WORKERS.values()) | {SUPERVISOR} <= set(given_a_spec)
    untyped = {str(p.relative_to(REPO)): lines for p in given_a_spec if (lines := untyped_spec_reads(p))}
    assert untyped == {}, f"these programs read their spec untyped: {untyped}"
    models = {str(p.relative_to(REPO)): spec_models_read(p) for p in given_a_spec}
    specs = {s.__name__ for s in all_specs()}
    assert {p: m for p, m in models.items() if len(m) != 1 or m[0] not in specs} == {}


def test_the_scan_finds_an_untyped_spec_read(tmp_path):
    planted = tmp_path / "worker.py"
    planted.write_text("import argparse\nfrom tasks import events\nspec = events.read_spec(None)\n"
                       "a = argparse.Namespace(**spec)\n")
    assert untyped_spec_reads(planted) == [3, 4] and spec_models_read(planted) == []


def all_specs(cls=events.ProgramSpec) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *all_specs(sub))]


def test_program_specs_default_nothing():
    """Every value a launched program reads comes from a config model, where the defaults live."""
    specs = all_specs()
    assert {s.__name__ for s in specs} >= {"SupervisorSpec", "LmEvalSpec", "LmEvalServer", "LmEvalLocal",
                                           "SglProgramSpec", "ConvertSpec", "FinetuneSpec", "RlhfSpec", "RewardSpec",
                                           "PretrainSpec", "PretrainTraining", "NodeSpec", "NodePlacement",
                                           "SlurmJobSpec", "RayDriverSpec"}
    defaulted = {f"{s.__name__}.{name}" for s in specs for name, f in s.model_fields.items() if not f.is_required()}
    assert defaulted == set()


def test_the_supervisor_refuses_a_spec_naming_the_field(tmp_path):
    """The same model validates the spec on the reader's side: a field another baton version wrote (or a typo in a
    hand-edited spec) ends the supervisor at once with the file and the field, before any engine starts."""
    good = events.SupervisorSpec(name="vllm", log=tmp_path / "s.log", state=tmp_path / "s.json",
                                 url="http://127.0.0.1:9", restarts=2, health_timeout_s=600.0,
                                 cmd=[sys.executable, "-c", "pass"])
    spec = json.loads(good.model_dump_json())
    spec["restart"] = spec.pop("restarts")
    path = tmp_path / "spec.json"
    events.write_spec(path, spec)
    r = subprocess.run([sys.executable, str(SUPERVISOR), "--spec", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == f"{path}: not a valid SupervisorSpec (restarts, restart)"
    assert not (tmp_path / "s.log").exists()


def stage_spec(stage: str, tmp_path) -> dict:
    """The spec the stage's task writes from configs/tiny.yaml, as JSON, for a run in tmp_path."""
    from flows.config import load
    from tasks.pretrain.task import build_spec
    from tasks.rlhf.task import worker_spec
    from tasks.stage import StageContext

    cfg = load(TINY, [], stages=["data", "pretrain", "rlhf"])
    ctx = StageContext(stage=stage, run_id="t", run_dir=tmp_path, work_dir=tmp_path / stage, seed=0,
                       model=cfg.model.model_dump(), data_dir=tmp_path / "data",
                       input=tmp_path / "input" if stage == "rlhf" else None)
    spec = (worker_spec(ctx, cfg.rlhf, tmp_path / "rlhf" / "checkpoint") if stage == "rlhf" else
            build_spec(ctx, cfg.pretrain, vocab=cfg.model.vocab_size))
    written = events.write_spec(tmp_path / "written.json", spec)
    return json.loads(written.read_text())


def misspelt(spec: dict, *where: str) -> dict:
    """The spec with its field at `where` (a path of keys) renamed without its last letter."""
    *outer, name = where
    inner = spec
    for key in outer:
        inner = inner[key]
    inner[name[:-1]] = inner.pop(name)
    return spec


@pytest.mark.parametrize("stage, where, message", [
    ("rlhf", ("steps",), "not a valid RlhfSpec (steps, step)"),
    ("pretrain", ("config", "steps"), "not a valid PretrainSpec (config.steps, config.step)"),
])
def test_a_training_worker_refuses_a_spec_naming_the_field(tmp_path, stage, where, message):
    """The worker process itself (as its stage launches it) ends at once on a spec another baton version wrote: one
    line with the file and the field, before any engine or process group starts, and nothing written."""
    spec = misspelt(stage_spec(stage, tmp_path), *where)
    path = events.write_spec(tmp_path / "written.json", spec)
    r = subprocess.run([sys.executable, str(WORKERS[stage]), "--spec", str(path)], capture_output=True, text=True,
                       timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == f"{path}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["written.json"]


# ---- the code sandbox's child (tasks/rlhf/sandbox_child.py): its whole job on stdin, checked on both sides --------
def positional_argv_reads(path) -> list[int]:
    """Lines that read a positional `sys.argv[i]`, a JSON document (`json.loads(sys.argv[1])`) included: a spec
    belongs in a model, read with events.read_typed_spec (`--spec FILE`, or `--spec-json` across hosts)."""
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "argv"]


def test_no_launched_program_reads_positional_arguments():
    """The sandbox child once took MEMORY_MB CPU_S ISOLATION as argv beside its JSON job, and the Slurm, Ray and node
    launchers a dict as one JSON argument: values with no model."""
    assert {REPO / "tasks/rlhf/sandbox_child.py", *DISTRIBUTED.values()} <= set(launched_programs())
    positional = {str(p.relative_to(REPO)): lines for p in launched_programs() if (lines := positional_argv_reads(p))}
    assert positional == {}, f"these programs take positional arguments, not one spec: {positional}"


def test_the_scan_finds_a_positional_argument(tmp_path):
    planted = tmp_path / "child.py"
    planted.write_text("import json, sys\nmemory = int(sys.argv[1])\nspec = json.loads(sys.argv[2])\n")
    assert positional_argv_reads(planted) == [2, 3]


# ---- the multi-node launchers (tasks/distributed): a spec on the command line, its nodes share no file with us ------
def test_each_launcher_reads_its_own_model():
    models = {name: spec_models_read(path) for name, path in DISTRIBUTED.items()}
    assert models == {"node": ["NodeSpec"], "slurm": ["SlurmJobSpec"], "ray_driver": ["RayDriverSpec"]}


def _spec_of(cmd: list[str], model):
    assert cmd[-2] == "--spec-json"
    return events.read_typed_spec(model, cmd[-2:])


def test_the_launch_comes_back_whole_through_each_launchers_spec(monkeypatch, tmp_path):
    from tasks.distributed import NodeSpec, RayDriverSpec, SlurmJobSpec, engine_command

    launch = Launch(python="py", script="w.py", args=("--spec", "s.json"), nnodes=2, nproc_per_node=4,
                    launcher="deepspeed", master_port=29500, env={"OMP_NUM_THREADS": "1"})
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    node = _spec_of(engine_command(launch, {"kind": "slurm", "srun_args": ["--partition=gpu"]}), NodeSpec)
    assert node == NodeSpec(launch=launch, placement=None)
    monkeypatch.delenv("SLURM_JOB_ID")
    job = _spec_of(engine_command(launch, {"kind": "slurm", "sbatch_args": ["--time=1:00:00"]}, tmp_path),
                   SlurmJobSpec)
    assert (job.launch, job.work_dir, job.runtime["sbatch_args"]) == (launch, tmp_path, ["--time=1:00:00"])
    ray = _spec_of(engine_command(launch, {"kind": "ray", "address": "head:6379", "resources_per_node": {"GPU": 8}}),
                   RayDriverSpec)
    assert (ray.launch, ray.address, ray.resources_per_node) == (launch, "head:6379", {"GPU": 8.0})


def test_a_node_refuses_a_spec_naming_the_field(tmp_path):
    """The node launcher as srun or Ray starts it ends at once on a spec another baton version wrote: one line naming
    the spec and the field, before any launcher starts."""
    from tasks.distributed import NodePlacement, NodeSpec

    launch = Launch(python=sys.executable, script=str(tmp_path / "w.py"), nnodes=2, nproc_per_node=1,
                    launcher="torchrun", master_port=0)
    spec = json.loads(NodeSpec(launch=launch, placement=NodePlacement(node_rank=1, master_addr="127.0.0.1",
                                                                     master_port=9)).model_dump_json())
    spec["launch"]["nnode"] = spec["launch"].pop("nnodes")
    r = subprocess.run([sys.executable, "-m", "tasks.distributed.node", "--spec-json", json.dumps(spec)], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0 and "node 1/" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "--spec-json: not a valid NodeSpec (launch.nnodes, launch.nnode)"


def test_the_sandbox_takes_its_limits_from_the_config_alone():
    """No default of its own in the limits, nor in the reward code that reads an rlhf.rewards entry (`spec.get(k) or
    5.0` once stood for rlhf.rewards[].timeout_s): the entry is whole, the config model holds the defaults."""
    import dataclasses

    from tasks.rlhf import sandbox

    defaulted = [f.name for f in dataclasses.fields(sandbox.Limits) if f.default is not dataclasses.MISSING]
    assert defaulted == []
    spec_gets = [c.lineno for c in calls_named(REPO / "tasks/rlhf/rewards.py", "get")
                 if getattr(getattr(c.func, "value", None), "id", None) == "spec"]
    assert spec_gets == [], f"tasks/rlhf/rewards.py reads a reward spec with a default of its own at {spec_gets}"


def test_the_sandbox_child_refuses_a_job_its_parent_would_not_send(tmp_path):
    """The parent builds the job and checks it with the child's own job_problem; the child checks it again and runs
    nothing of a job with a field misspelt (exit BAD_JOB, no results written)."""
    from tasks.rlhf import sandbox, sandbox_child

    limits = sandbox.Limits(timeout_s=10, memory_mb=256, isolation="limits_only")
    job = sandbox.child_job("print('ran')", ["assert True"], limits, nonce="n")
    assert sandbox_child.job_problem(job) is None and job["cpu_s"] == 11
    with pytest.raises(ValueError, match="the job's isolation is 'maybe'"):
        sandbox.child_job("", ["pass"], sandbox.Limits(timeout_s=1, memory_mb=256, isolation="maybe"), nonce="n")
    job["memory"] = job.pop("memory_mb")
    r = subprocess.run([sys.executable, "-I", str(sandbox.CHILD)], input=json.dumps(job).encode(), cwd=tmp_path,
                       env=sandbox.child_env(str(tmp_path)), capture_output=True, timeout=60)
    assert r.returncode == sandbox_child.BAD_JOB and list(tmp_path.iterdir()) == []
    job["memory_mb"] = job.pop("memory")
    r = subprocess.run([sys.executable, "-I", str(sandbox.CHILD)], input=json.dumps(job).encode(), cwd=tmp_path,
                       env=sandbox.child_env(str(tmp_path)), capture_output=True, timeout=60)
    assert r.returncode == 0 and "n pass 0" in (tmp_path / "results").read_text()


def test_a_detached_server_takes_its_supervisor_s_values_from_the_config(tmp_path):
    """The supervisor's spec is written by Server.start from serve.restarts and serve.health_timeout_s: Server has no
    default of its own for either (its `restarts=0` once stood where the config says 2), and a detached server given
    neither is refused before anything starts."""
    import inspect

    from tasks.serve.config import ServeConfig
    from tasks.serve.server import Server

    params = inspect.signature(Server).parameters
    assert {k: params[k].default for k in ("restarts", "health_timeout")} == {"restarts": None, "health_timeout": None}
    assert {"restarts", "health_timeout_s"} <= set(events.SupervisorSpec.model_fields) & set(ServeConfig.model_fields)
    server = Server("engine", [sys.executable, "-c", "pass"], {}, "http://127.0.0.1:9", tmp_path / "s.log", str,
                    managed=False, health_timeout=60)
    with pytest.raises(ValueError, match=r"serve\.restarts"):
        server.start()
    assert server.proc is None and list(tmp_path.iterdir()) == []


def test_a_launch_takes_its_layout_launcher_and_port_from_the_stage_config():
    """tasks.distributed.Launch once defaulted nnodes and nproc_per_node to 1, the launcher to torchrun (finetune's
    config says deepspeed) and the port to 0: a field a training config sets has no default there."""
    import dataclasses

    from tasks.distributed import Launch
    from tasks.finetune.config import FinetuneConfig
    from tasks.pretrain.config import PretrainConfig
    from tasks.rlhf.config import RlhfConfig

    config_keys = {k for c in (FinetuneConfig, PretrainConfig, RlhfConfig) for k in c.model_fields}
    launch_fields = {f.name: f for f in dataclasses.fields(Launch)}
    assert {"nnodes", "nproc_per_node", "launcher", "master_port"} <= config_keys & set(launch_fields)
    defaulted = {name for name, f in launch_fields.items() if name in config_keys and
                 (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)}
    assert defaulted == set()
