"""The nemo_rl backend without a GPU: the YAML baton writes (loads with OmegaConf, inherits NeMo-RL's recipe through
`defaults:`, sets only keys NeMo-RL has, with types it accepts), the exact launch commands, and the clear refusal on a
CPU machine.

NeMo-RL itself cannot run here (GPU only). Its recipes are stood in by YAMLs rebuilt from fixtures/nemo_rl_recipes.json:
facts read from a pinned NVIDIA-NeMo/RL commit (every recipe key path and its type, the upstream values these tests
need, the keys its config types declare beyond the recipe, the scripts baton runs). Re-read them when moving the pin:
`make nemo-rl-facts NEMO_RL=<git dir of NVIDIA-NeMo/RL>` (CHECK=1 only compares; infra/facts/nemo_rl.py).
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


# grpo as NeMo-RL runs it: one exact_match (its math environment), weighted so that reward_scaling is written too
GRPO = dict(algorithm="grpo", micro_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
            max_completion_length=24, temperature=0.7, beta=0.04, clip_epsilon=0.2, clip_epsilon_high=0.28, loss_type="grpo",
            scale_rewards="none", rewards=[{"kind": "exact_match", "extract": "boxed", "weight": 2.0}])


def rlhf_config(algorithm: str) -> RlhfConfig:
    return RlhfConfig(**GRPO) if algorithm == "grpo" else RlhfConfig(algorithm=algorithm)


def our_config(runtime: dict, cfg: RlhfConfig | None = None, algorithm: str = "dpo") -> dict:
    return nemo_rl.build_config(algorithm=algorithm, runtime=runtime, input_dir=INPUT, data_dir=DATA, out_dir=OUT,
                                cfg=cfg or rlhf_config(algorithm), seed=7, max_length=128,
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
    overridden = command_line_overrides(rlhf_config(algorithm), runtime)
    facts = RECIPE_FACTS[algorithm]
    problems = [p for key, value in [*written.items(), *overridden.items()] if (p := type_problem(facts, key, value))]
    assert problems == []


@pytest.mark.parametrize("algorithm", sorted(nemo_rl.KEYS_READ))
def test_every_key_an_algorithm_reads_is_a_real_nemo_rl_key(algorithm):
    facts = RECIPE_FACTS[algorithm]
    unknown = [key for key in nemo_rl.KEYS_READ[algorithm] if key not in facts["keys"] and key not in facts["declared"]]
    assert unknown == []


@pytest.mark.parametrize("algorithm", sorted(nemo_rl.RECIPES))
def test_the_resolved_config_misses_no_key(algorithm, tmp_path):
    """Merged over the recipe and resolved: every recipe key is still there (and every key DPO reads), and the
    recipe's interpolations resolve to the types upstream's do."""
    checkout = stand_in_checkout(tmp_path / "RL")
    runtime = {"kind": "venv", "path": str(checkout)}
    path = nemo_rl.write_config(tmp_path / f"nemo_rl_{algorithm}.yaml", our_config(runtime, algorithm=algorithm))
    cfg = nemo_rl.resolve(path, nemo_rl.overrides(rlhf_config(algorithm), runtime))
    facts = RECIPE_FACTS[algorithm]
    assert nemo_rl.missing_keys(cfg, keys=tuple(facts["keys"])) == []
    assert nemo_rl.missing_keys(cfg, keys=nemo_rl.KEYS_READ.get(algorithm, ())) == []
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


def filled_from_default(data: dict, split: str) -> dict:
    """A dataset entry as NeMo-RL's setup_response_data hands it to ResponseDataset: data.default fills the keys the
    entry lacks (update_single_dataset_config), the entry's own keys win."""
    return {**(data.get("default") or {}), **data[split]}


def test_grpo_yaml_runs_the_math_recipe_with_our_rewards_and_data(tmp_path):
    checkout = stand_in_checkout(tmp_path / "RL")
    runtime = {"kind": "venv", "path": str(checkout), "nodes": 1}
    rl = RlhfConfig(**GRPO)
    path = nemo_rl.write_config(tmp_path / "nemo_rl_grpo.yaml", our_config(runtime, rl, algorithm="grpo"))
    assert OmegaConf.load(path).defaults == str(checkout / "examples" / "configs" / "grpo_math_1B.yaml")
    cfg = nemo_rl.resolve(path, nemo_rl.overrides(rl, runtime))
    upstream = RECIPE_FACTS["grpo"]["values"]

    grpo, loss = cfg["grpo"], cfg["loss_fn"]
    assert upstream["grpo.num_generations_per_prompt"] != 4 and grpo["num_generations_per_prompt"] == 4
    # 8 completions × 2 accumulation = 16 a step: 4 prompts of 4, one optimizer step on all of them
    assert grpo["num_prompts_per_step"] == 4 and cfg["policy"]["train_global_batch_size"] == 16
    assert grpo["max_num_steps"] == rl.steps and grpo["val_at_end"] and upstream["grpo.val_at_end"] is False
    assert upstream["grpo.normalize_rewards"] and grpo["normalize_rewards"] is False  # scale_rewards none
    assert grpo["adv_estimator"]["normalize_rewards"] is False  # the recipe's ${grpo.normalize_rewards}, resolved
    assert upstream["grpo.use_leave_one_out_baseline"] and grpo["adv_estimator"]["use_leave_one_out_baseline"] is False
    assert grpo["reward_scaling"] == {"enabled": True, "source_min": 0.0, "source_max": 1.0, "target_min": 0.0,
                                      "target_max": 2.0}  # the reward's weight
    assert upstream["loss_fn.reference_policy_kl_penalty"] != 0.04 and loss["reference_policy_kl_penalty"] == 0.04
    assert (loss["ratio_clip_min"], loss["ratio_clip_max"]) == (0.2, 0.28)
    assert upstream["loss_fn.token_level_loss"] and loss["token_level_loss"] is False  # loss_type grpo
    assert cfg["policy"]["generation"]["max_new_tokens"] == 24 and cfg["policy"]["generation"]["temperature"] == 0.7
    assert cfg["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 128  # inherited interpolation, resolved
    assert cfg["policy"]["sequence_packing"]["train_mb_tokens"] == 128 * rl.nemo_rl.micro_batch_size  # ${mul:...}
    assert (cfg["checkpointing"]["metric_name"], cfg["checkpointing"]["higher_is_better"]) == ("val:accuracy", True)
    assert cfg["checkpointing"]["save_consolidated"] and not upstream["checkpointing.save_consolidated"]

    assert upstream["data.train.split_validation_size"] > 0 and upstream["data.validation"] is None
    assert upstream["data.default.prompt_file"] == "examples/prompts/cot.txt"
    for split, name in (("train", "train"), ("validation", "heldout")):
        entry = filled_from_default(cfg["data"], split)
        assert entry["dataset_name"] == "ResponseDataset" and entry["data_path"] == str(OUT / "data" /
                                                                                        f"prompts_{name}.jsonl")
        assert (entry["input_key"], entry["output_key"], entry["split"]) == ("prompt", "answer", "train")
        assert entry["prompt_file"] is None and entry["split_validation_size"] == 0  # our prompts, as written
        assert (entry["processor"], entry["env_name"]) == ("math_hf_data_processor", "math")
    assert cfg["env"]["math"]["math_verify_impl"] == upstream["env.math.math_verify_impl"] == "hf_math_verify"
    assert upstream["policy.sequence_packing.enabled"] and cfg["policy"]["sequence_packing"]["enabled"] is False
    packed = nemo_rl.write_config(tmp_path / "packed.yaml", our_config(runtime, RlhfConfig(**GRPO, packing=True),
                                                                       algorithm="grpo"))
    assert nemo_rl.resolve(packed, [])["policy"]["sequence_packing"]["enabled"] is True  # rlhf.packing: true


def write_prompts(data_dir: Path, rows: dict[str, list[dict]]) -> Path:
    (data_dir / "prompts").mkdir(parents=True)
    for split, split_rows in rows.items():
        (data_dir / "prompts" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    return data_dir


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_prompt_files_are_what_the_math_recipe_reads(tmp_path):
    """The columns written are the ones the config names (input_key, output_key): the prompt's text, the answer from
    the reward's answer_field as text (the math environment wraps it in \\boxed{})."""
    data = write_prompts(tmp_path / "data", {
        "train": [{"prompt": user("3+4="), "answer": "x", "total": 7}, {"prompt": user("2+2="), "total": "4"}],
        "heldout": [{"prompt": user("1+5="), "answer": "6", "total": 6.5}]})
    paths = nemo_rl.prompt_files(data, tmp_path / "nr", answer_field="total")
    section = nemo_rl.data_section("grpo", tmp_path / "nr", 128)
    assert [section["train"]["data_path"], section["validation"]["data_path"]] == [str(paths["train"]),
                                                                                   str(paths["heldout"])]
    keys = (section["train"]["input_key"], section["train"]["output_key"])
    rows = {split: [json.loads(line) for line in path.read_text().splitlines()] for split, path in paths.items()}
    assert rows == {"train": [dict(zip(keys, ("3+4=", "7"))), dict(zip(keys, ("2+2=", "4")))],
                    "heldout": [dict(zip(keys, ("1+5=", "6.5")))]}
    with pytest.raises(ValueError, match=r"train.jsonl:2: column 'answer' \(rlhf.rewards\[0\].answer_field\) is "
                                         r"None"):
        nemo_rl.prompt_files(data, tmp_path / "nr", answer_field="answer")  # the second train row has none


def test_a_prompt_of_several_messages_is_refused_naming_its_line(tmp_path):
    system = [{"role": "system", "content": "Be brief."}, *user("3+4=")]
    data = write_prompts(tmp_path / "data", {"train": [{"prompt": user("1+1="), "answer": "2"},
                                                       {"prompt": system, "answer": "7"}],
                                             "heldout": [{"prompt": user("1+5="), "answer": "6"}]})
    with pytest.raises(ValueError, match=r"prompts/train.jsonl:2: NeMo-RL's math recipe takes a prompt of one user "
                                         r"message \(this one has 2: system, user\); use rlhf.backend=trl"):
        nemo_rl.prompt_files(data, tmp_path / "nr", answer_field="answer")


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
        "rlhf.backend=nemo_rl,rlhf.algorithm=grpo,runtimes.nemo_rl.kind=slurm": "rlhf.rewards: backend nemo_rl runs "
                                                                                 "grpo on rlhf.rewards",
        "rlhf.packing=true": r"rlhf.packing: TRL 1.16's DPOTrainer has no packing, and its padding_free is switched "
                             r"off since its DPO refactor \(it warns and pads anyway\); nothing would be packed",
        "rlhf.algorithm=rm,rlhf.packing=true": "rlhf.packing: TRL 1.16's RewardTrainer has no packing",
        "rlhf.algorithm=grpo,rlhf.packing=true": "rlhf.packing: TRL 1.16's GRPOTrainer has no packing",
        "rlhf.backend=nemo_rl,rlhf.packing=true,runtimes.nemo_rl.kind=slurm": "rlhf.packing: NeMo-RL's DPO refuses "
                                                                            "sequence packing",
        "rlhf.backend=nemo_rl,rlhf.algorithm=rm,rlhf.packing=true,runtimes.nemo_rl.kind=slurm":
            "rlhf.packing: NeMo-RL's reward-model recipe does not pack",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
            load(TINY, overrides.split(","))


def grpo_on_nemo_rl(tmp_path: Path, rlhf: dict) -> Path:
    """A run config: grpo on NeMo-RL through Slurm (a checkout with ray.sub, an image: a CPU machine gets as far as the
    rlhf checks), synthetic prompts with answers."""
    raw = yaml.safe_load(TINY.read_text())
    raw["rlhf"] = {"backend": "nemo_rl", "algorithm": "grpo", "micro_batch_size": 8, "num_generations": 4, **rlhf}
    raw["data"]["prompts"] = {"kind": "synthetic"}
    raw.setdefault("runtimes", {})["nemo_rl"] = {"kind": "slurm", "path": str(stand_in_checkout(tmp_path / "RL")),
                                                 "image": "nvcr.io/nvidia/nemo-rl:v0.7.0"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_grpo_with_one_math_answer_reward_goes_to_nemo_rl(tmp_path):
    cfg = load(grpo_on_nemo_rl(tmp_path, {"rewards": [{"kind": "exact_match", "extract": "boxed"}], "packing": True}),
               host=False)
    assert checks.resolve_backend(cfg.rlhf, cfg.runtimes) == "nemo_rl"
    launch = nemo_rl.launch_command(algorithm="grpo", cfg=cfg.rlhf, runtime={"kind": "venv", "path": "/opt/RL"},
                                    config_path=OUT / "nemo_rl_grpo.yaml", mounts=[])
    assert launch.cwd == Path("/opt/RL") and launch.cmd == [
        "uv", "run", "python", "examples/run_grpo.py", "--config", str(OUT / "nemo_rl_grpo.yaml"),
        "cluster.gpus_per_node=8", "cluster.num_nodes=1"]


EXACT = {"kind": "exact_match"}
FUNCTION = {"kind": "function", "function": "{tmp}/rewards.py:close_enough"}


@pytest.mark.parametrize("rlhf, line", [
    ({"rewards": [EXACT, {"kind": "regex", "pattern": "^\\d+$"}]},
     "rlhf.rewards[1]: NeMo-RL's math recipe scores each completion with one environment, and rlhf.rewards[0] is it "
     "(use rlhf.backend=trl to sum rewards)"),
    ({"rewards": [FUNCTION]}, "rlhf.rewards[0]: a user function runs in baton's TRL worker; NeMo-RL scores with its "
                              "own environments and cannot call it (use rlhf.backend=trl)"),
    ({"rewards": [{"kind": "regex", "pattern": "\\d"}]}, "rlhf.rewards[0]: kind regex has no NeMo-RL environment "
                                                        "(baton runs exact_match through its math environment; use "
                                                        "rlhf.backend=trl)"),
    ({"rewards": [{"kind": "json_schema", "json_schema": {"type": "object"}}]},
     "rlhf.rewards[0]: kind json_schema has no NeMo-RL environment"),
    ({"rewards": [{"kind": "length", "max_chars": 9}]}, "rlhf.rewards[0]: kind length has no NeMo-RL environment"),
    ({"rewards": [{"kind": "code_tests", "isolation": "limits_only"}]},
     "rlhf.rewards[0]: kind code_tests has no NeMo-RL environment"),
    ({"rewards": [{"kind": "exact_match", "extract": "full"}]},
     "rlhf.rewards[0].extract: full has no NeMo-RL environment (its math environment reads the last \\boxed{} or the "
     "last expression: extract boxed or last_number; use rlhf.backend=trl)"),
    ({"rewards": [EXACT], "loss_type": "dr_grpo"}, "rlhf.loss_type: dr_grpo has no NeMo-RL counterpart"),
    ({"rewards": [EXACT], "scale_rewards": "batch"}, "rlhf.scale_rewards: batch has no NeMo-RL counterpart"),
])
def test_what_nemo_rl_cannot_run_is_refused_in_one_line_naming_it(tmp_path, rlhf, line):
    (tmp_path / "rewards.py").write_text("def close_enough(prompt, completion, **row):\n    return 1.0\n")
    rlhf = json.loads(json.dumps(rlhf).replace("{tmp}", str(tmp_path)))
    with pytest.raises(ConfigError) as refused:
        load(grpo_on_nemo_rl(tmp_path, rlhf), host=False)
    problems = [p.strip() for p in str(refused.value).splitlines()[1:]]
    assert len(problems) == 1 and problems[0].startswith(line), problems


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


def test_a_grpo_output_is_measured_by_the_rewards_as_written(tmp_path, hf_checkpoint, data_dir, capsys):
    """After NeMo-RL (its math environment), the gate measures input and output with baton's own rewards on the
    held-out prompts; the worker only evaluates (same weights here: the same reward), it trains nothing."""
    from test_rlhf_trl import prompts_data

    from tasks import events
    from tasks.rlhf import worker
    from tasks.rlhf.task import worker_command
    from tasks.stage import StageContext

    data = prompts_data(data_dir, tmp_path / "data")
    ctx = StageContext(stage="rlhf", run_id="test", run_dir=tmp_path, work_dir=tmp_path, model={}, seed=0,
                       data_dir=data, input=hf_checkpoint, input_format="hf-safetensors")
    cmd = worker_command(ctx, RlhfConfig(**GRPO), hf_checkpoint, evaluate=True)
    capsys.readouterr()
    worker.main(cmd[cmd.index("--spec"):])
    result = next(e for e in map(events.parse, capsys.readouterr().out.splitlines()) if e and e["kind"] == "result")
    assert result["metric"] == "heldout_reward" and result["heldout_prompts"] == 22, result
    assert result["before"] == result["after"] and result["solved_before"] == result["solved_after"], result
    assert not (hf_checkpoint.parent / f"{hf_checkpoint.name}.trl").exists()  # no trainer ran
