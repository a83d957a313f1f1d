"""The nemo_rl backend without a GPU: the YAML baton writes (loads with OmegaConf, inherits NeMo-RL's recipe through
`defaults:`, sets only keys NeMo-RL has, with types it accepts), the exact launch commands, and the clear refusal on a
CPU machine.

NeMo-RL itself cannot run here (GPU only). Its recipes are stood in by YAMLs rebuilt from fixtures/nemo_rl_recipes.json:
facts read from a pinned NVIDIA-NeMo/RL commit (every recipe key path and its type, the upstream values these tests
need, the keys its config types declare beyond the recipe, the scripts baton runs). Re-read them when moving the pin.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from conftest import TINY, baton
from flows.config import ConfigError, load
from tasks.rlhf import checks, nemo_rl
from tasks.rlhf.config import RlhfConfig

INPUT, DATA, OUT = Path("/ckpt/policy"), Path("/runs/data"), Path("/runs/r1/01-rlhf/nemo_rl")
FACTS = json.loads((Path(__file__).parent / "fixtures" / "nemo_rl_recipes.json").read_text())
RECIPE_FACTS = FACTS["recipes"]
no_gpu = pytest.mark.skipif(checks.has_nvidia_gpu(), reason="this machine has a GPU")


def set_dotted(tree: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def placeholder(key: str, type_name: str):
    """A value of the recorded type; a string names its key so that an inherited value is recognisable."""
    if type_name == "str":
        return f"recipe:{key}"
    return {"int": 3, "float": 0.5, "bool": False, "null": None, "list": [], "dict": {}}[type_name]


def recipe_from_facts(facts: dict) -> dict:
    """The recipe's shape with placeholders of each key's type, and the upstream value where one is recorded
    (interpolations among them, so they resolve as upstream's do)."""
    recipe = {"defaults": facts["defaults"]} if facts["defaults"] else {}
    for key, type_name in facts["keys"].items():  # parents come before their children
        set_dotted(recipe, key, facts["values"][key] if key in facts["values"] else placeholder(key, type_name))
    return recipe


def stand_in_checkout(root: Path) -> Path:
    """A directory shaped like the pinned NeMo-RL checkout: its recipes rebuilt from the facts, its scripts empty."""
    for facts in RECIPE_FACTS.values():
        recipe = root / facts["file"]
        recipe.parent.mkdir(parents=True, exist_ok=True)
        recipe.write_text(yaml.safe_dump(recipe_from_facts(facts), sort_keys=False))
    for script in FACTS["scripts"]:
        (root / script).parent.mkdir(parents=True, exist_ok=True)
        (root / script).write_text("")
    return root


def our_config(runtime: dict, cfg: RlhfConfig | None = None, algorithm: str = "dpo") -> dict:
    return nemo_rl.build_config(algorithm=algorithm, runtime=runtime, input_dir=INPUT, data_dir=DATA, out_dir=OUT,
                                cfg=cfg or RlhfConfig(algorithm=algorithm), seed=7, max_length=128,
                                tracking_uri="http://mlflow:5000", experiment="baton", mlflow_run_id="stage-run-id")


def leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) for every value that is not a non-empty dict."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def type_name(value) -> str:
    for python_type, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "list"),
                              (dict, "dict")):
        if isinstance(value, python_type):
            return name
    return "null"


def type_problem(facts: dict, key: str, value) -> str | None:
    """Why NeMo-RL would not take `value` at `key`, or None. A type its code declares wins over the recipe's value."""
    expected = facts["declared"][key]["type"] if key in facts["declared"] else facts["keys"].get(key)
    if expected is None:
        return f"{key}: not in {facts['file']}, nor declared by NeMo-RL's config types"
    allowed, actual = expected.split("|"), type_name(value)
    if actual in allowed or (actual == "int" and "float" in allowed):  # pydantic takes an int for a float
        return None
    return f"{key}: {actual} {value!r}, where NeMo-RL has {expected}"


def command_line_overrides(cfg: RlhfConfig, runtime: dict) -> dict:
    parsed = OverridesParser.create().parse_overrides(nemo_rl.overrides(cfg, runtime))
    return {o.key_or_group: o.value() for o in parsed}


def test_the_facts_cover_every_algorithm_and_script_baton_runs():
    assert FACTS["source"]["repository"] == "https://github.com/NVIDIA-NeMo/RL" and len(FACTS["source"]["commit"]) == 40
    for algorithm, (base, script, section) in nemo_rl.RECIPES.items():
        facts = RECIPE_FACTS[algorithm]
        assert (facts["file"], facts["entry"], facts["keys"][section]) == (base, script, "dict")
        assert "--config" in FACTS["scripts"][script]
    assert {"--config", "--dcp-ckpt-path", "--hf-ckpt-path"} <= set(FACTS["scripts"][nemo_rl.CONVERTER])
    assert "ray.sub" in FACTS["scripts"]


@pytest.mark.parametrize("algorithm", sorted(nemo_rl.RECIPES))
def test_every_key_baton_sets_is_one_nemo_rl_has_with_a_type_it_takes(algorithm):
    """Each key our YAML writes or the command line overrides is in the recipe or declared by NeMo-RL's config types
    (the fixture says where: CheckpointingConfig, TokenizerConfig, DTensorConfig, MLflowConfig,
    PreferenceDatasetConfig, DPOConfig), with a type that NeMo-RL's validation accepts."""
    runtime = {"kind": "venv", "path": "/opt/RL", "nodes": 2}
    written = {k: v for k, v in leaves(our_config(runtime, algorithm=algorithm)) if k != "defaults"}
    overridden = command_line_overrides(RlhfConfig(algorithm=algorithm), runtime)
    facts = RECIPE_FACTS[algorithm]
    problems = [p for key, value in [*written.items(), *overridden.items()] if (p := type_problem(facts, key, value))]
    assert problems == []


def test_every_key_dpo_needs_is_a_real_nemo_rl_key():
    facts = RECIPE_FACTS["dpo"]
    unknown = [key for key in nemo_rl.DPO_KEYS if key not in facts["keys"] and key not in facts["declared"]]
    assert unknown == []


@pytest.mark.parametrize("algorithm", sorted(nemo_rl.RECIPES))
def test_the_resolved_config_misses_no_key(algorithm, tmp_path):
    """Merged over the recipe and resolved: every recipe key is still there (and every key DPO reads), and the
    recipe's interpolations resolve to the types upstream's do."""
    checkout = stand_in_checkout(tmp_path / "RL")
    runtime = {"kind": "venv", "path": str(checkout)}
    path = nemo_rl.write_config(tmp_path / f"nemo_rl_{algorithm}.yaml", our_config(runtime, algorithm=algorithm))
    cfg = nemo_rl.resolve(path, nemo_rl.overrides(RlhfConfig(algorithm=algorithm), runtime))
    facts = RECIPE_FACTS[algorithm]
    assert nemo_rl.missing_keys(cfg, keys=tuple(facts["keys"])) == []
    assert algorithm != "dpo" or nemo_rl.missing_keys(cfg) == []
    resolved = OmegaConf.create(cfg)
    interpolated = [key for key, value in facts["values"].items() if "${" in str(value)]
    problems = [p for key in interpolated if (p := type_problem(facts, key, OmegaConf.select(resolved, key)))]
    assert problems == []


def test_yaml_loads_inherits_and_our_choices_win(tmp_path):
    checkout = stand_in_checkout(tmp_path / "RL")
    runtime = {"kind": "venv", "path": str(checkout), "nodes": 2}
    path = nemo_rl.write_config(tmp_path / "nemo_rl_dpo.yaml", our_config(runtime))

    raw = OmegaConf.load(path)  # plain OmegaConf: the file itself is valid and names its parent
    assert raw.defaults == str(checkout / "examples" / "configs" / "dpo.yaml")
    cfg = nemo_rl.resolve(path, nemo_rl.overrides(RlhfConfig(), runtime))
    upstream = RECIPE_FACTS["dpo"]["values"]
    assert cfg["dpo"]["preference_average_log_probs"] is upstream["dpo.preference_average_log_probs"]  # inherited
    assert cfg["dpo"]["sft_average_log_probs"] is upstream["dpo.preference_average_log_probs"]  # ${.…}, resolved
    assert upstream["dpo.reference_policy_kl_penalty"] != 0.1 and upstream["dpo.sft_loss_weight"] != 1.0
    assert cfg["dpo"]["reference_policy_kl_penalty"] == 0.1 and cfg["dpo"]["sft_loss_weight"] == 1.0  # ours win
    assert cfg["dpo"]["max_num_steps"] == RlhfConfig().steps
    assert cfg["policy"]["model_name"] == str(INPUT) and cfg["policy"]["tokenizer"]["name"] == str(INPUT)
    assert cfg["data"]["max_input_seq_length"] == 128  # the recipe's interpolation, resolved against our value
    assert upstream["data.validation.split"] == "validation"  # HelpSteer3's; a local jsonl has only `train`
    for split, name in (("train", "train"), ("validation", "heldout")):
        d = cfg["data"][split]
        assert d["split"] == "train" and d["dataset_name"] == "BinaryPreferenceDataset"
        assert d["data_path"] == str(OUT / "data" / f"{name}.jsonl")
        assert (d["prompt_key"], d["chosen_key"], d["rejected_key"]) == ("prompt", "chosen", "rejected")
    assert cfg["checkpointing"]["model_save_format"] == "safetensors" and cfg["checkpointing"]["save_consolidated"]
    assert cfg["checkpointing"]["checkpoint_dir"] == str(OUT / "results")
    assert upstream["logger.mlflow_enabled"] is False
    assert cfg["logger"]["mlflow_enabled"] and cfg["logger"]["mlflow"] == {
        "experiment_name": "baton", "run_name": "rlhf", "tracking_uri": "http://mlflow:5000", "run_id": "stage-run-id"}
    assert cfg["cluster"] == {"gpus_per_node": 8, "num_nodes": 2, "segment_size": None}


def test_overrides_follow_nemo_rl_rules(tmp_path):
    checkout = stand_in_checkout(tmp_path / "RL")
    path = nemo_rl.write_config(tmp_path / "c.yaml", our_config({"kind": "venv", "path": str(checkout)}))
    cfg = nemo_rl.resolve(path, ["dpo.sft_loss_weight=0.1", "+policy.hf_config_overrides.rope_theta=5e5"])
    assert cfg["dpo"]["sft_loss_weight"] == 0.1 and cfg["policy"]["hf_config_overrides"]["rope_theta"] == 5e5
    with pytest.raises(KeyError, match=r"\+policy.no_such_key"):
        nemo_rl.resolve(path, ["policy.no_such_key=1"])


def test_launch_from_a_checkout():
    cfg = RlhfConfig(nemo_rl={"gpus_per_node": 4, "overrides": ["dpo.sft_loss_weight=0.1"]})
    launch = nemo_rl.launch_command(algorithm="dpo", cfg=cfg, runtime={"kind": "venv", "path": "/opt/RL", "nodes": 1},
                                    config_path=OUT / "nemo_rl_dpo.yaml", mounts=[])
    assert launch.cwd == Path("/opt/RL") and launch.env == {}
    assert launch.cmd == ["uv", "run", "python", "examples/run_dpo.py", "--config", str(OUT / "nemo_rl_dpo.yaml"),
                          "cluster.gpus_per_node=4", "cluster.num_nodes=1", "dpo.sft_loss_weight=0.1"]


def test_launch_in_the_container():
    runtime = {"kind": "container", "image": "nvcr.io/nvidia/nemo-rl:v0.7.0", "nodes": 1}
    launch = nemo_rl.launch_command(algorithm="rm", cfg=RlhfConfig(algorithm="rm"), runtime=runtime,
                                    config_path=OUT / "nemo_rl_rm.yaml", mounts=[OUT.parent, INPUT, DATA])
    assert launch.cmd == [
        "docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
        "-v", "/ckpt/policy:/ckpt/policy", "-v", "/runs/data:/runs/data", "-v", f"{OUT.parent}:{OUT.parent}",
        "-w", "/opt/nemo-rl", "nvcr.io/nvidia/nemo-rl:v0.7.0",
        "uv", "run", "python", "examples/run_rm.py", "--config", str(OUT / "nemo_rl_rm.yaml"),
        "cluster.gpus_per_node=8", "cluster.num_nodes=1"]


def test_launch_multi_node_through_ray_sub():
    cfg = RlhfConfig(nemo_rl={"slurm_account": "llm", "slurm_partition": "batch", "slurm_time": "2:0:0"})
    runtime = {"kind": "slurm", "path": "/shared/RL", "image": "nvcr.io/nvidia/nemo-rl:v0.7.0", "nodes": 4}
    launch = nemo_rl.launch_command(algorithm="dpo", cfg=cfg, runtime=runtime, config_path=OUT / "nemo_rl_dpo.yaml",
                                    mounts=[OUT.parent, INPUT, DATA, Path("/shared/RL")])
    assert launch.cwd == Path("/shared/RL")
    assert launch.cmd == ["sbatch", "--wait", "--nodes=4", "--gres=gpu:8", "--job-name=baton-rlhf", "--time=2:0:0",
                          "--account=llm", "--partition=batch", "ray.sub"]
    assert shlex.split(launch.env["COMMAND"]) == [
        "uv", "run", "python", "examples/run_dpo.py", "--config", str(OUT / "nemo_rl_dpo.yaml"),
        "cluster.gpus_per_node=8", "cluster.num_nodes=4"]
    assert launch.env["CONTAINER"] == "nvcr.io/nvidia/nemo-rl:v0.7.0" and launch.env["GPUS_PER_NODE"] == "8"
    assert launch.env["MOUNTS"].split(",") == [f"{p}:{p}" for p in sorted(map(str, (OUT.parent, INPUT, DATA,
                                                                                     Path("/shared/RL"))))]


@no_gpu
def test_nemo_rl_on_cpu_fails_before_launch_with_one_clear_error(baton_home):
    t0 = time.time()
    r = baton("run", str(TINY), "--stages", "rlhf", "--set", "rlhf.backend=nemo_rl", home=baton_home, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("  ")]
    assert len(errors) == 1 and "needs an NVIDIA GPU" in errors[0] and "rlhf.backend=trl" in errors[0], r.stderr
    assert not (baton_home / "runs").exists()  # nothing launched, no run created
    assert time.time() - t0 < 120


@no_gpu
def test_auto_picks_trl_without_a_gpu_even_with_nemo_rl_configured(tmp_path):
    cfg = load(TINY, [f"runtimes.nemo_rl.path={stand_in_checkout(tmp_path / 'RL')}"])
    assert cfg.rlhf.backend == "auto" and checks.resolve_backend(cfg.rlhf, cfg.runtimes) == "trl"


def test_bad_settings_are_refused_before_launch(tmp_path):
    cases = {
        "rlhf.beta=0": "DPO needs beta > 0",
        "rlhf.algorithm=grpo,rlhf.beta=-1": "KL coefficient cannot be negative",
        "rlhf.algorithm=grpo,rlhf.micro_batch_size=6": "multiple of rlhf.num_generations",
        "rlhf.num_generations=8": "rlhf.num_generations: only used by algorithm grpo",
        "rlhf.algorithm=rm,rlhf.reference=precomputed": "rlhf.reference: only used by algorithm dpo",
        f"rlhf.reference_model={tmp_path}": "is not an HF checkpoint folder",
        "rlhf.max_seq_length=4096": "exceeds model.seq_length",
        "rlhf.algorithm=ppo": "rlhf.algorithm",
        "rlhf.backend=nemo_rl,rlhf.algorithm=grpo,runtimes.nemo_rl.kind=slurm": "grpo needs a NeMo-RL environment",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
            load(TINY, overrides.split(","))


def test_reads_consolidated_weights_and_adds_the_tokenizer(tmp_path, hf_checkpoint, data_dir, capsys):
    """NeMo-RL's documented output layout (step_N/policy/weights/model/consolidated) → a complete, gated HF folder."""
    from transformers import AutoModelForCausalLM

    from conversions import verify

    model = AutoModelForCausalLM.from_pretrained(str(hf_checkpoint))
    for step in (3, 12):  # the newest step is taken
        weights = tmp_path / "results" / f"step_{step}" / "policy" / "weights"
        model.save_pretrained(str(weights / "model" / "consolidated"))
    step = nemo_rl.latest_step(tmp_path / "results")
    assert step.name == "step_12"
    out = nemo_rl.collect_hf(nemo_rl.consolidated_dir(step), tmp_path / "checkpoint", hf_checkpoint)
    assert (out / "chat_template.jinja").exists() and (out / "tokenizer.json").exists()
    rep = verify.verify(out, against=hf_checkpoint, levels=("preflight", "L1", "L2"))
    assert rep["passed"], verify.format_report(rep)
    assert nemo_rl.consolidated_dir(tmp_path / "results" / "missing") is None
    conv = nemo_rl.converter_command(cfg=RlhfConfig(), runtime={"kind": "venv", "path": "/opt/RL"}, step_dir=step,
                                     hf_dir=tmp_path / "hf", mounts=[])
    assert conv.cwd == Path("/opt/RL") and conv.cmd == [
        "uv", "run", "python", "examples/converters/convert_dcp_to_hf.py", "--config", str(step / "config.yaml"),
        "--dcp-ckpt-path", str(step / "policy" / "weights"), "--hf-ckpt-path", str(tmp_path / "hf")]

    from tasks import events
    from tasks.rlhf import worker
    from tasks.rlhf.task import worker_command
    from tasks.stage import StageContext

    ctx = StageContext(stage="rlhf", run_id="test", run_dir=tmp_path, work_dir=tmp_path, model={}, seed=0,
                       data_dir=data_dir, input=hf_checkpoint, input_format="hf-safetensors")
    cmd = worker_command(ctx, RlhfConfig(), out, evaluate=True)  # the command the stage launches after NeMo-RL
    capsys.readouterr()
    worker.main(cmd[cmd.index("--spec"):])
    result = next(e for e in map(events.parse, capsys.readouterr().out.splitlines()) if e and e["kind"] == "result")
    assert result["metric"] == "heldout_pref_accuracy" and result["before"] == result["after"]  # same weights
    assert abs(result["heldout_kl_to_reference"]) < 1e-6
