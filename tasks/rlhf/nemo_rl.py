"""The nemo_rl backend: the YAML NeMo-RL reads, the command that runs it, and the HF folder made from what it writes.

NeMo-RL (GPU only, Python 3.13, a uv project) is never imported. It runs as its own program from a checkout
(`runtimes.nemo_rl: {kind: venv, path: ...}`), its NGC container (`kind: container, image: ...`; the checkout is
/opt/nemo-rl inside), or on Slurm through the checkout's `ray.sub` (`kind: slurm`, multi-node with `nodes`).
Our YAML inherits NeMo-RL's own recipe through `defaults:` and overrides only what baton decides.
Key names follow NVIDIA-NeMo/RL at 7ea279ab (2026-08-22); DPO_KEYS and GRPO_KEYS list what its DPO and GRPO read.

GRPO runs NeMo-RL's math recipe: one rlhf.rewards entry, exact_match on the last number or the last \\boxed{}, becomes
its math environment, which scores a completion 1.0 when math-verify finds its final answer (the last \\boxed{} or
expression) equal to the row's answer, compared as mathematics rather than as text. Every other reward is refused
before launch (checks.nemo_rl_reward_errors).
"""
from __future__ import annotations

import json

import glob
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from conversions import durable
from conversions.probe import DTYPE_OF_PRECISION

CONTAINER_PATH = "/opt/nemo-rl"         # WORKDIR of the nvcr.io/nvidia/nemo-rl images
RECIPES = {                              # algorithm -> (base config, entry script, its top-level section)
    "dpo": ("examples/configs/dpo.yaml", "examples/run_dpo.py", "dpo"),
    "rm": ("examples/configs/rm.yaml", "examples/run_rm.py", "rm"),
    "grpo": ("examples/configs/grpo_math_1B.yaml", "examples/run_grpo.py", "grpo"),
}
CONVERTER = "examples/converters/convert_dcp_to_hf.py"

# Every key NeMo-RL's DPO path reads (run_dpo.py, algorithms/dpo.py and its loss, data/utils.py, utils/checkpoint.py,
# utils/logger.py, models/policy), as dotted paths. The merged config must define each one.
DPO_KEYS = (
    "dpo.max_num_epochs", "dpo.max_num_steps", "dpo.val_period", "dpo.val_batches", "dpo.val_global_batch_size",
    "dpo.val_micro_batch_size", "dpo.val_at_start", "dpo.val_at_end", "dpo.seed", "dpo.reference_policy_kl_penalty",
    "dpo.preference_average_log_probs", "dpo.sft_average_log_probs", "dpo.preference_loss_weight",
    "dpo.sft_loss_weight",
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.checkpoint_must_save_by", "checkpointing.save_optimizer", "checkpointing.model_save_format",
    "checkpointing.save_consolidated",
    "policy.model_name", "policy.tokenizer.name", "policy.train_global_batch_size", "policy.train_micro_batch_size",
    "policy.max_total_sequence_length", "policy.precision", "policy.dtensor_cfg.enabled",
    "policy.dtensor_cfg.tensor_parallel_size", "policy.dtensor_cfg.context_parallel_size",
    "policy.dtensor_cfg.sequence_parallel", "policy.dtensor_cfg.activation_checkpointing",
    "policy.dtensor_cfg.cpu_offload", "policy.dynamic_batching.enabled", "policy.sequence_packing.enabled",
    "policy.make_sequence_length_divisible_by", "policy.max_grad_norm", "policy.optimizer.name",
    "policy.optimizer.kwargs.lr", "policy.scheduler", "policy.megatron_cfg.enabled",
    "policy.megatron_cfg.use_fused_linear_logprobs",
    "data.max_input_seq_length", "data.shuffle", "data.num_workers", "data.train.dataset_name",
    "data.train.data_path", "data.validation.dataset_name", "data.validation.data_path",
    "logger.log_dir", "logger.wandb_enabled", "logger.tensorboard_enabled", "logger.mlflow_enabled",
    "logger.swanlab_enabled", "logger.monitor_gpus", "logger.wandb", "logger.gpu_monitoring.collection_interval",
    "logger.gpu_monitoring.flush_interval", "logger.mlflow.experiment_name", "logger.mlflow.run_name",
    "logger.mlflow.tracking_uri", "logger.mlflow.run_id",
    "cluster.gpus_per_node", "cluster.num_nodes",
)
# What its GRPO reads beyond the shared policy/logger/cluster keys (run_grpo.py, algorithms/grpo.py, its ClippedPGLoss,
# data/utils.py setup_response_data, environments/math_environment.py).
GRPO_KEYS = (
    "grpo.num_prompts_per_step", "grpo.num_generations_per_prompt", "grpo.max_num_epochs", "grpo.max_num_steps",
    "grpo.normalize_rewards", "grpo.use_leave_one_out_baseline", "grpo.val_period", "grpo.val_at_start",
    "grpo.val_at_end", "grpo.max_val_samples", "grpo.val_batch_size", "grpo.seed", "grpo.async_grpo.enabled",
    "grpo.reward_scaling.enabled", "grpo.adv_estimator.name", "grpo.adv_estimator.normalize_rewards",
    "grpo.adv_estimator.use_leave_one_out_baseline",
    "loss_fn.reference_policy_kl_penalty", "loss_fn.ratio_clip_min", "loss_fn.ratio_clip_max",
    "loss_fn.token_level_loss",
    "checkpointing.enabled", "checkpointing.checkpoint_dir", "checkpointing.metric_name",
    "checkpointing.higher_is_better", "checkpointing.keep_top_k", "checkpointing.save_period",
    "checkpointing.model_save_format", "checkpointing.save_consolidated",
    "policy.model_name", "policy.tokenizer.name", "policy.train_global_batch_size", "policy.train_micro_batch_size",
    "policy.max_total_sequence_length", "policy.precision", "policy.generation.backend",
    "policy.generation.max_new_tokens", "policy.generation.temperature", "policy.optimizer.kwargs.lr",
    "policy.sequence_packing.enabled", "policy.sequence_packing.train_mb_tokens",
    "policy.draft.enabled",
    "data.max_input_seq_length", "data.train.dataset_name", "data.train.data_path", "data.train.input_key",
    "data.train.output_key", "data.train.prompt_file", "data.train.processor", "data.train.env_name",
    "data.validation.data_path", "data.validation.env_name", "env.math.num_workers", "env.math.math_verify_impl",
    "logger.log_dir", "logger.mlflow_enabled", "logger.mlflow.tracking_uri", "logger.mlflow.run_id",
    "cluster.gpus_per_node", "cluster.num_nodes",
)
KEYS_READ = {"dpo": DPO_KEYS, "grpo": GRPO_KEYS}
# TRL's loss_type → NeMo-RL's loss_fn.token_level_loss: DAPO averages over every token of the batch (token level),
# GRPO over each completion's tokens, then over completions (sequence level). dr_grpo and bnpo have no counterpart.
TOKEN_LEVEL_LOSS = {"dapo": True, "grpo": False}
# rlhf.scale_rewards → grpo.normalize_rewards (advantages divided by the group's reward std, or not); no batch std.
NORMALIZE_REWARDS = {"group": True, "none": False}


def recipe_root(runtime: dict) -> str:
    """Where the NeMo-RL checkout is, as seen by the process that runs it."""
    if runtime.get("path"):
        return str(runtime["path"])
    return CONTAINER_PATH


def preference_files(data_dir: Path, out_dir: Path) -> dict[str, Path]:
    """The data stage's canonical pairs as NeMo-RL's BinaryPreferenceDataset reads them: the prompt as messages, each
    reply a string (multi-message replies have no place there and are refused)."""
    paths = {}
    for split in ("train", "heldout"):
        src, dst = data_dir / "preference" / f"{split}.jsonl", out_dir / "data" / f"{split}.jsonl"
        dst.parent.mkdir(parents=True, exist_ok=True)
        rows = []
        for n, line in enumerate(src.read_text().splitlines(), start=1):
            r = json.loads(line)
            if len(r["chosen"]) != 1 or len(r["rejected"]) != 1:
                raise ValueError(f"{src}:{n}: NeMo-RL's BinaryPreferenceDataset takes one reply message per side "
                                 "(use rlhf.backend=trl for multi-message replies)")
            rows.append(json.dumps({"prompt": r["prompt"], "chosen": r["chosen"][0]["content"],
                                    "rejected": r["rejected"][0]["content"]}))
        dst.write_text("".join(x + "\n" for x in rows))
        paths[split] = dst
    return paths


def _preference_file(path: Path) -> dict:
    # split: train, because a local jsonl loads as one `train` split (the base recipe asks for `validation`); not
    # null, which NeMo-RL's config validation refuses (PreferenceDatasetConfig.split is a str)
    return {"dataset_name": "BinaryPreferenceDataset", "data_path": str(path), "prompt_key": "prompt",
            "chosen_key": "chosen", "rejected_key": "rejected", "split": "train"}


def _answer_text(row: dict, field_name: str, where: str) -> str:
    answer = row.get(field_name)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"{where}: column {field_name!r} (rlhf.rewards[0].answer_field) is {answer!r}; NeMo-RL's "
                         "math environment compares the reply with an answer written as text or a number")
    return str(answer)


def prompt_files(data_dir: Path, out_dir: Path, answer_field: str) -> dict[str, Path]:
    """The data stage's prompts with answers as NeMo-RL's ResponseDataset reads them for its math recipe: the prompt
    as the text of its one user message, the answer as text (the math environment wraps it in \\boxed{} and compares
    mathematically). A prompt of several messages has no place there (math_hf_data_processor takes the first message
    as the problem) and is refused."""
    paths = {}
    for split in ("train", "heldout"):
        src, dst = data_dir / "prompts" / f"{split}.jsonl", out_dir / "data" / f"prompts_{split}.jsonl"
        rows = []
        for n, line in enumerate(src.read_text().splitlines(), start=1):
            r = json.loads(line)
            if [m["role"] for m in r["prompt"]] != ["user"]:
                raise ValueError(f"{src}:{n}: NeMo-RL's math recipe takes a prompt of one user message (this one has "
                                 f"{len(r['prompt'])}: {', '.join(m['role'] for m in r['prompt'])}); use "
                                 "rlhf.backend=trl for system or multi-turn prompts")
            rows.append(json.dumps({"prompt": r["prompt"][0]["content"],
                                    "answer": _answer_text(r, answer_field, f"{src}:{n}")}))
        paths[split] = durable.write_text(dst, "".join(x + "\n" for x in rows))
    return paths


def _prompts_file(path: Path) -> dict:
    # the math recipe's defaults (data.default) name OpenMathInstruct-2's chain-of-thought prompt file; ours are the
    # data stage's prompts as written, so no prompt file, and no 5% of train split off as validation
    return {"dataset_name": "ResponseDataset", "data_path": str(path), "input_key": "prompt", "output_key": "answer",
            "split": "train", "split_validation_size": 0, "prompt_file": None, "system_prompt_file": None,
            "processor": "math_hf_data_processor", "env_name": "math"}


def _validation(steps: int) -> dict:
    """Validate at the start and at the last step only (the checkpoint keeps the best by a validation metric)."""
    return {"max_num_steps": steps, "max_num_epochs": 1000,  # steps decide; epochs only bound them
            "val_period": steps, "val_at_start": True, "val_at_end": True}


def algorithm_section(algorithm: str, cfg, seed: int) -> dict:
    """The recipe's own section (dpo:, rm:, grpo:) with baton's choices."""
    nr = cfg.nemo_rl
    if algorithm == "grpo":
        return {**_validation(cfg.steps), "seed": seed, "num_generations_per_prompt": cfg.num_generations,
                "num_prompts_per_step": cfg.micro_batch_size * cfg.accumulation() // cfg.num_generations,
                "normalize_rewards": NORMALIZE_REWARDS[cfg.scale_rewards],
                "use_leave_one_out_baseline": False,  # the group's plain mean, as TRL's GRPO (baton's meaning)
                **({"reward_scaling": {"enabled": True, "source_min": 0.0, "source_max": 1.0, "target_min": 0.0,
                                       "target_max": cfg.rewards[0].weight}}
                   if cfg.rewards and cfg.rewards[0].weight != 1 else {})}
    return {**_validation(cfg.steps), "val_batches": 0, "seed": seed,
            "val_global_batch_size": nr.gpus_per_node * nr.micro_batch_size,
            "val_micro_batch_size": nr.micro_batch_size,
            **({"reference_policy_kl_penalty": cfg.beta, "sft_loss_weight": cfg.sft_weight}
               if algorithm == "dpo" else {})}


def grpo_loss(cfg) -> dict:
    return {"reference_policy_kl_penalty": cfg.beta, "ratio_clip_min": cfg.clip_epsilon,
            "ratio_clip_max": cfg.clip_epsilon_high or cfg.clip_epsilon,
            "token_level_loss": TOKEN_LEVEL_LOSS[cfg.loss_type]}


def data_section(algorithm: str, out_dir: Path, max_length: int) -> dict:
    """The files preference_files() or prompt_files() write, as the recipe's data section reads them."""
    if algorithm == "grpo":
        return {"max_input_seq_length": max_length, "train": _prompts_file(out_dir / "data" / "prompts_train.jsonl"),
                "validation": _prompts_file(out_dir / "data" / "prompts_heldout.jsonl")}
    return {"max_input_seq_length": max_length, "train": _preference_file(out_dir / "data" / "train.jsonl"),
            "validation": _preference_file(out_dir / "data" / "heldout.jsonl")}


# the checkpoint kept: the best by this validation metric (GRPO's math environment reports accuracy)
BEST_BY = {"grpo": ("val:accuracy", True)}


def build_config(*, algorithm: str, runtime: dict, input_dir: Path, data_dir: Path, out_dir: Path, cfg, seed: int,
                 max_length: int, tracking_uri: str, experiment: str, mlflow_run_id: str | None,
                 chat_template: str | None = None) -> dict:
    """The YAML content: NeMo-RL's recipe via `defaults:`, then baton's choices."""
    base, _, section = RECIPES[algorithm]
    nr = cfg.nemo_rl
    steps = cfg.steps
    metric, higher_is_better = BEST_BY.get(algorithm, ("val:validation-default_loss", False))
    policy = {
        "model_name": str(input_dir),
        "tokenizer": {"name": str(input_dir), "chat_template": chat_template or "default"},  # "default": its own
        "train_global_batch_size": cfg.micro_batch_size * cfg.accumulation(),
        "train_micro_batch_size": nr.micro_batch_size,
        "max_total_sequence_length": max_length,
        "precision": DTYPE_OF_PRECISION[nr.precision],
        "dtensor_cfg": {"enabled": True, "_v2": True},
        "optimizer": {"kwargs": {"lr": cfg.lr}},
    }
    if algorithm == "grpo":
        policy["generation"] = {"max_new_tokens": cfg.max_completion_length, "temperature": cfg.temperature}
        policy["sequence_packing"] = {"enabled": cfg.packing}  # the recipe packs; baton's default does not
    return {
        "defaults": f"{recipe_root(runtime)}/{base}",
        section: algorithm_section(algorithm, cfg, seed),
        **({"loss_fn": grpo_loss(cfg)} if algorithm == "grpo" else {}),
        "checkpointing": {
            "enabled": True, "checkpoint_dir": str(out_dir / "results"), "save_period": steps, "keep_top_k": 1,
            "metric_name": metric, "higher_is_better": higher_is_better, "save_optimizer": False,
            "model_save_format": "safetensors", "save_consolidated": True,
        },
        "policy": policy,
        "data": data_section(algorithm, out_dir, max_length),
        "logger": {
            "log_dir": str(out_dir / "logs"), "mlflow_enabled": True, "wandb_enabled": False,
            "tensorboard_enabled": False, "swanlab_enabled": False,
            "mlflow": {"experiment_name": experiment, "run_name": "rlhf", "tracking_uri": tracking_uri,
                       "run_id": mlflow_run_id},
        },
        "cluster": {"gpus_per_node": nr.gpus_per_node, "num_nodes": int(runtime.get("nodes") or 1)},
    }


def write_config(path: Path, config: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by baton's rlhf stage for NeMo-RL; inherits its recipe through `defaults:`\n"
                    + yaml.safe_dump(config, sort_keys=False))
    return path


def overrides(cfg, runtime: dict) -> list[str]:
    """key=value overrides on the command line: cluster shape, then the user's own (last, so they win)."""
    return [f"cluster.gpus_per_node={cfg.nemo_rl.gpus_per_node}",
            f"cluster.num_nodes={int(runtime.get('nodes') or 1)}", *cfg.nemo_rl.overrides]


# ---- the config as NeMo-RL will see it (checked before launch wherever its recipes are on this machine) ------------
def load_with_defaults(path: Path):
    """OmegaConf config with `defaults:` parents merged under it, depth first, later parents winning (as NeMo-RL)."""
    from omegaconf import OmegaConf

    path = Path(path)
    cfg = OmegaConf.load(path)
    defaults = cfg.pop("defaults", None)
    if defaults is None:
        return cfg
    base = OmegaConf.create({})
    for parent in [defaults] if isinstance(defaults, str) else list(defaults):
        p = Path(str(parent))
        base = OmegaConf.merge(base, load_with_defaults(p if p.is_absolute() else path.parent / p))
    return OmegaConf.merge(base, cfg)


def apply_overrides(cfg, items: list[str]):
    """key=value overrides with Hydra's grammar. Like NeMo-RL (struct mode) an unknown key is an error; +key adds."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    for o in OverridesParser.create().parse_overrides(items):
        key = o.key_or_group
        if not o.is_add() and OmegaConf.select(cfg, key, default=KeyError) is KeyError:
            raise KeyError(f"override {key}: no such key in the NeMo-RL config (to add a new key write +{key}=...)")
        OmegaConf.update(cfg, key, o.value(), force_add=o.is_add())
    return cfg


# the arithmetic resolvers NeMo-RL registers before loading a config (nemo_rl/utils/config.py); its GRPO recipes use
# ${mul:...} for the token budgets of dynamic batching and sequence packing
RESOLVERS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b, "max": max}


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def resolve(config_path: Path, items: list[str]) -> dict:
    """The final config run_<algorithm>.py would build: inheritance, overrides, interpolations resolved."""
    from omegaconf import OmegaConf

    register_resolvers()
    return OmegaConf.to_container(apply_overrides(load_with_defaults(config_path), items), resolve=True)


def missing_keys(config: dict, keys=DPO_KEYS) -> list[str]:
    def has(node, parts):
        for p in parts:
            if not isinstance(node, dict) or p not in node:
                return False
            node = node[p]
        return True

    return [k for k in keys if not has(config, k.split("."))]


@dataclass
class Launch:
    cmd: list[str]
    cwd: Path | None = None
    env: dict = field(default_factory=dict)


def in_runtime(run: list[str], *, cfg, runtime: dict, mounts: list[Path], nodes: int | None = None) -> Launch:
    """Wrap a command meant for a NeMo-RL checkout: there (venv), in its container, or on Slurm through ray.sub."""
    kind = runtime.get("kind", "venv")
    if kind == "venv":
        return Launch(run, cwd=Path(runtime["path"]))
    binds = sorted({str(Path(m)) for m in mounts})
    if kind == "container":
        vols = [a for m in binds for a in ("-v", f"{m}:{m}")]
        return Launch(["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "--ulimit", "memlock=-1",
                       "--ulimit", "stack=67108864", *vols, "-w", recipe_root(runtime), runtime["image"], *run])
    if kind == "slurm":
        nr = cfg.nemo_rl
        nodes = nodes or int(runtime.get("nodes") or 1)
        sbatch = ["sbatch", "--wait", f"--nodes={nodes}", f"--gres=gpu:{nr.gpus_per_node}", "--job-name=baton-rlhf",
                  f"--time={nr.slurm_time}"]
        sbatch += [f"--account={nr.slurm_account}"] if nr.slurm_account else []
        sbatch += [f"--partition={nr.slurm_partition}"] if nr.slurm_partition else []
        env = {"COMMAND": shlex.join(run), "CONTAINER": runtime["image"], "MOUNTS": ",".join(f"{m}:{m}" for m in binds),
               "GPUS_PER_NODE": str(nr.gpus_per_node)}
        return Launch([*sbatch, "ray.sub"], cwd=Path(runtime["path"]), env=env)
    raise ValueError(f"runtimes.nemo_rl.kind={kind!r}: supported kinds are venv (a checkout), container, slurm")


def launch_command(*, algorithm: str, cfg, runtime: dict, config_path: Path, mounts: list[Path]) -> Launch:
    """`uv run python examples/run_<algo>.py --config <ours> key=value...` in the runtime."""
    _, script, _ = RECIPES[algorithm]
    run = ["uv", "run", "python", script, "--config", str(config_path), *overrides(cfg, runtime)]
    return in_runtime(run, cfg=cfg, runtime=runtime, mounts=mounts)


def converter_command(*, cfg, runtime: dict, step_dir: Path, hf_dir: Path, mounts: list[Path]) -> Launch:
    """NeMo-RL's own DCP → HF converter, for checkpoints saved without consolidated safetensors (one node)."""
    run = ["uv", "run", "python", CONVERTER, "--config", str(step_dir / "config.yaml"),
           "--dcp-ckpt-path", str(step_dir / "policy" / "weights"), "--hf-ckpt-path", str(hf_dir)]
    return in_runtime(run, cfg=cfg, runtime=runtime, mounts=mounts, nodes=1)


# ---- reading what NeMo-RL wrote --------------------------------------------------------------------------------------
def latest_step(results: Path) -> Path | None:
    steps = [Path(p) for p in glob.glob(str(results / "step_*")) if re.fullmatch(r"step_\d+", Path(p).name)]
    return max(steps, key=lambda p: int(p.name.split("_")[1])) if steps else None


def consolidated_dir(step_dir: Path) -> Path | None:
    """The HF folder (config.json + *.safetensors) inside a step's policy weights, if it was saved consolidated."""
    weights = step_dir / "policy" / "weights"
    for cand in (weights / "model" / "consolidated", weights / "consolidated", weights / "model", weights):
        if (cand / "config.json").exists() and any(cand.glob("*.safetensors")):
            return cand
    return None


def collect_hf(src: Path, out: Path, tokenizer_src: Path, chat_template: Path | None = None) -> Path:
    """Copy NeMo-RL's HF weights and config, then the input's tokenizer and chat template (NeMo-RL does not), or the
    configured template when the input has none."""
    from conversions import folder, hf, safetensors_stream
    from tasks import chat

    out.mkdir(parents=True, exist_ok=True)
    for f in [*src.glob("*.safetensors"), src / safetensors_stream.INDEX_NAME, src / "config.json", src / "generation_config.json"]:
        if f.exists():
            folder.copy_file(f, out / f.name)
    hf.copy_tokenizer(tokenizer_src, out, chat_template=chat_template)
    if chat_template is not None:
        chat.add_end_of_turn_stop(out)
    return out
