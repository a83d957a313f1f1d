"""`baton doctor`: seeded misconfigurations, each named with its fix, against real probes (a venv without psutil, a
bound port, a tmpfs mounted for the test); the tiny config passes clean; `baton run` refuses to launch on an error."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from flows.cli import doctor
from flows.cli import main as baton_main
from flows.config import load
from tasks.problems import ConfigProblem

pytestmark = pytest.mark.fast
TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"


def findings(overrides=(), probe=None, stages=None):
    cfg = load(TINY, list(overrides), stages, check_stages=False)
    return doctor.doctor(cfg, probe or doctor.Probe())


def the(found, check):
    hits = [f for f in found if f.check == check]
    assert hits, f"{check} not reported; got {[f.check for f in found]}"
    return hits[0]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs root, as in CI containers)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_tiny_config_passes_clean():
    assert findings() == []


def test_tensor_parallel_not_dividing_heads():
    f = the(findings(["pretrain.tensor_parallel=3", "pretrain.nproc_per_node=3"]), "tp_heads")
    assert f.severity == "error" and "num_attention_heads 4" in f.cause
    assert f.fix == "pretrain.tensor_parallel: one of [1, 2]"


def test_config_findings_carry_their_key_and_leave_head_counts_to_tp_heads():
    """The stages' own problems become findings whose fix names the key each problem carries as data (never parsed
    out of its sentence); those about tensor_parallel against the head counts are tp_heads' (it lists valid sizes)."""
    found = findings(["pretrain.tensor_parallel=3", "pretrain.nproc_per_node=3", "serve.tensor_parallel=4",
                      "finetune.zero.stage=5"])
    config = {f.cause: f.fix for f in found if f.check == "config"}
    assert not [c for c in config if "num_attention_heads" in c or "num_query_groups" in c], config
    assert config["pretrain.tensor_parallel 3: model.ffn_hidden_size 344 is not divisible by it"] == \
        "change pretrain.tensor_parallel"
    assert config["serve.tensor_parallel: > 1 needs device: cuda (the CPU recipes serve on one process)"] == \
        "change serve.tensor_parallel"
    assert config["finetune.zero.stage: 5 is not a ZeRO stage (1, 2 or 3)"] == "change finetune.zero.stage"
    assert {"pretrain.tensor_parallel", "serve.tensor_parallel"} <= {f.fix.split(":")[0] for f in found
                                                                     if f.check == "tp_heads"}


def test_every_stage_problem_carries_its_key():
    cfg = load(TINY, ["pretrain.tensor_parallel=3", "pretrain.min_lr=1", "rlhf.beta=-1", "finetune.zero.stage=5",
                      "serve.api_key_file=/nonexistent"], check_stages=False)
    problems = cfg.validate_stages()
    assert len(problems) >= 5
    assert all(isinstance(p, ConfigProblem) and p.startswith(p.key) for p in problems), problems
    with pytest.raises(ValueError, match="names its key first"):
        ConfigProblem("serve.port", "the port is taken")


def test_zero3_without_zero_init():
    f = the(findings(["finetune.zero.stage=3", "finetune.zero.init=false"]), "zero3_without_init")
    assert f.fix == "finetune.zero.init: true"


def test_sixteen_dataloader_workers():
    f = the(findings(["rlhf.dataloader_workers=16"]), "dataloader_workers")
    assert f.fix == "rlhf.dataloader_workers: 4"


def test_vllm_gpu_memory_utilization_099():
    f = the(findings(["serve.gpu_memory_utilization=0.99"]), "gpu_memory_utilization")
    assert "outside 0.5-0.9" in f.cause and f.fix == "serve.gpu_memory_utilization: 0.85"


def test_prompt_logprobs_on():
    assert the(findings(["serve.prompt_logprobs=5"]), "prompt_logprobs").fix == "serve.prompt_logprobs: 0"


def test_runtime_without_psutil(tmp_path):
    env = tmp_path / "bare"
    venv.create(env, with_pip=False)  # a real interpreter with nothing installed
    py = env / "bin" / "python"
    f = the(findings([f"runtimes.main.python={py}"], stages=["data", "pretrain"]), "psutil_missing")
    assert f.severity == "error" and f.fix == f"{py} -m pip install psutil"


@pytest.mark.skipif(bool(doctor._gpus()), reason="the trap is on machines without GPUs")
def test_deepspeed_launcher_without_num_gpus():
    found = doctor.doctor(None, doctor.Probe(launch_command="deepspeed train.py --deepspeed ds.json"))
    assert "--num_gpus" in the(found, "deepspeed_num_gpus").fix
    ok = doctor.doctor(None, doctor.Probe(launch_command="deepspeed --num_gpus 2 train.py --deepspeed ds.json"))
    assert ok == []


def test_too_little_disk_for_checkpoints(small_tmpfs):
    f = the(findings(probe=doctor.Probe(home=small_tmpfs)), "disk_for_checkpoints")
    assert f.severity == "error" and "keep_checkpoints" in f.fix


def test_disk_plan_counts_the_checkpoint_in_flight():
    """A save writes the new checkpoint before it removes the oldest: keep 1 still needs room for two. An fp32 ZeRO
    checkpoint holds 16 bytes a parameter (weights, the fp32 partition, two Adam moments); the fp32 output 4 more."""
    cfg = load(TINY, ["finetune.keep_checkpoints=1"], ["finetune"], check_stages=False)
    m = cfg.model
    d = m.hidden_size // m.num_attention_heads
    layer = (m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * d
             + m.num_attention_heads * d * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size + 2 * m.hidden_size)
    params = m.num_layers * layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size  # untied, GQA counted
    assert doctor.planned_checkpoint_bytes(cfg) == params * (2 * 16 + 4)


@pytest.mark.parametrize("stage", ["pretrain", "rlhf", "finetune"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_doctor_disk_estimate_equals_the_stages_own(stage, precision):
    from flows import chain_planner
    from flows.step_runner import disk_needed

    cfg = load(TINY, [f"{stage}.precision={precision}", f"{stage}.keep_checkpoints=3"], [stage], check_stages=False)
    (step,) = [s for s in chain_planner.plan(cfg, input_format=None if stage == "pretrain" else "hf-safetensors")
               if s.name == stage]
    assert doctor.planned_checkpoint_bytes(cfg) == disk_needed(cfg, step) > 0
def test_port_taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        f = the(findings([f"serve.port={port}"]), "port_in_use")
    assert f.fix.startswith("serve.port=0")


def test_shm_too_small(small_tmpfs):
    f = the(findings(probe=doctor.Probe(shm_dir=small_tmpfs)), "shm_too_small")
    assert "2 ranks" in f.cause and "nproc_per_node" in f.fix


def test_memory_estimate_beyond_this_machine():
    big = ["model.num_layers=80", "model.hidden_size=8192", "model.num_attention_heads=64", "model.num_query_groups=8",
           "model.ffn_hidden_size=28672"]
    f = the(findings(big, stages=["data", "pretrain"]), "memory_estimate")
    assert f.severity == "error" and f.fix.startswith("baton plan CONFIG --stage pretrain")


def test_cli_exit_codes(capsys):
    assert baton_main(["doctor", str(TINY)]) == 0
    assert baton_main(["doctor", str(TINY), "--set", "serve.prompt_logprobs=1"]) == 0  # warnings do not fail
    assert baton_main(["doctor", str(TINY), "--set", "rlhf.dataloader_workers=16", "--set",
                       "pretrain.tensor_parallel=3"]) == 1
    out = capsys.readouterr().out
    assert "tp_heads" in out and "fix: pretrain.tensor_parallel: one of [1, 2]" in out


def test_run_refuses_before_launch(tmp_path):
    """An error stops `baton run` before any flow run, engine or server starts."""
    bare = tmp_path / "bare"
    venv.create(bare, with_pip=False)
    env = dict(os.environ, BATON_HOME=str(tmp_path / "home"))
    r = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY), "--stages", "data,pretrain",
                        "--set", f"runtimes.main.python={bare / 'bin' / 'python'}"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "psutil_missing" in r.stderr and "nothing was launched" in r.stderr
    assert not (tmp_path / "home" / "runs").exists()


@pytest.mark.skipif(bool(__import__("shutil").which("numactl")), reason="numactl is installed here")
def test_bind_cores_without_numactl():
    found = doctor.doctor(None, doctor.Probe(launch_command="deepspeed --num_gpus 2 --bind_cores_to_rank t.py"))
    assert the(found, "numactl_missing").fix.startswith("apt-get install numactl")
