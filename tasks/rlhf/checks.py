"""Which backend runs, and every config problem found before anything launches (cheap: no torch import)."""
from __future__ import annotations

import shutil
from pathlib import Path

from tasks.gates import lm_eval_errors
from tasks.hardware import visible_gpus

GRPO_ONLY = ("num_generations", "max_completion_length")
DPO_ONLY = ("reference", "reference_model", "sft_weight")


def has_nvidia_gpu() -> bool:
    return visible_gpus() > 0


def nemo_rl_runtime(runtimes: dict | None) -> dict:
    spec = (runtimes or {}).get("nemo_rl") or {}
    return spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)


def resolve_backend(cfg, runtimes: dict | None) -> str:
    """auto → nemo_rl only where it can run (a GPU here, a NeMo-RL runtime configured, an algorithm it runs)."""
    if cfg.backend != "auto":
        return cfg.backend
    if cfg.algorithm != "grpo" and (runtimes or {}).get("nemo_rl") and has_nvidia_gpu():
        return "nemo_rl"
    return "trl"


def runs_here_without_a_gpu(kind: str) -> bool:
    """NeMo-RL would run on this machine (a checkout or a container here, not a Slurm job) and it has no GPU."""
    return kind in ("venv", "container") and not has_nvidia_gpu()


def nemo_rl_errors(cfg, runtime: dict, host: bool = True) -> list[str]:
    """What the config lacks for NeMo-RL; `host`: also the tools this machine needs to launch it."""
    kind = runtime.get("kind", "venv")
    if runs_here_without_a_gpu(kind):  # decisive: nothing else matters on this machine
        return ["rlhf: backend nemo_rl needs an NVIDIA GPU on this machine and none was found (no /dev/nvidia*, no GPU "
                "from nvidia-smi); NeMo-RL has no CPU path. Use rlhf.backend=trl (or auto) here, or "
                "runtimes.nemo_rl.kind=slurm to submit to a GPU cluster"]
    errors = []
    if cfg.algorithm == "grpo":
        errors.append("rlhf: backend nemo_rl runs algorithm dpo or rm here; grpo needs a NeMo-RL environment for its "
                      "reward, which baton does not ship (use rlhf.backend=trl)")
    if kind == "venv":
        path = runtime.get("path")
        if not path:
            errors.append("runtimes.nemo_rl.path: the NeMo-RL checkout to run (git clone --recursive "
                          "https://github.com/NVIDIA-NeMo/RL), or set runtimes.nemo_rl.kind=container with an image")
        elif not (Path(path) / "examples" / "run_dpo.py").exists():
            errors.append(f"runtimes.nemo_rl.path: {path} is not a NeMo-RL checkout (no examples/run_dpo.py)")
    elif kind == "container":
        if not runtime.get("image"):
            errors.append("runtimes.nemo_rl.image: the NeMo-RL container image (e.g. nvcr.io/nvidia/nemo-rl:v0.7.0)")
    elif kind == "slurm":
        if not runtime.get("path") or not (Path(runtime["path"]) / "ray.sub").exists():
            errors.append("runtimes.nemo_rl.path: a NeMo-RL checkout with ray.sub, on storage the cluster shares")
        if not runtime.get("image"):
            errors.append("runtimes.nemo_rl.image: the container ray.sub starts on each node")
    else:
        errors.append(f"runtimes.nemo_rl.kind={kind!r}: supported kinds are venv (a checkout), container, slurm")
    return errors + (nemo_rl_tool_errors(kind) if host else [])


NEMO_RL_TOOLS = {"venv": ("uv", "rlhf: backend nemo_rl runs NeMo-RL with `uv run`, and uv is not on PATH"),
                 "container": ("docker", "rlhf: runtimes.nemo_rl.kind=container needs docker on PATH"),
                 "slurm": ("sbatch", "rlhf: runtimes.nemo_rl.kind=slurm needs sbatch on PATH")}


def nemo_rl_tool_errors(kind: str) -> list[str]:
    """The program this machine runs to launch NeMo-RL (not asked when the stage runs elsewhere, e.g. `baton k8s`)."""
    tool, message = NEMO_RL_TOOLS.get(kind, (None, ""))
    return [message] if tool and not shutil.which(tool) else []


def host_errors(cfg, pipeline) -> list[str]:
    runtimes = getattr(pipeline, "runtimes", None) or {}
    if resolve_backend(cfg, runtimes) != "nemo_rl":
        return []
    kind = nemo_rl_runtime(runtimes).get("kind", "venv")
    if runs_here_without_a_gpu(kind):
        return []  # validate's "needs an NVIDIA GPU" is decisive: nothing else matters on this machine
    return nemo_rl_tool_errors(kind)


def validate(cfg, pipeline) -> list[str]:
    errors = []
    set_keys = cfg.model_fields_set
    if cfg.gate.metric == "exact_match":
        errors.append("rlhf.gate.metric: exact_match is a finetune metric (heldout_loss, preference_accuracy or "
                      "lm_eval)")
    if cfg.gate.metric == "lm_eval" and cfg.algorithm == "rm":
        errors.append("rlhf.gate.metric: lm_eval scores a policy, and algorithm rm trains a reward model (its gate is "
                      "preference_accuracy)")
    errors += lm_eval_errors(cfg.gate, "rlhf")
    if cfg.algorithm == "dpo" and cfg.beta <= 0:
        errors.append(f"rlhf.beta: DPO needs beta > 0 (got {cfg.beta})")
    if cfg.algorithm == "grpo" and cfg.beta < 0:
        errors.append(f"rlhf.beta: the GRPO KL coefficient cannot be negative (got {cfg.beta})")
    if cfg.algorithm == "grpo" and cfg.micro_batch_size % cfg.num_generations:
        errors.append(f"rlhf.micro_batch_size {cfg.micro_batch_size} must be a multiple of rlhf.num_generations "
                      f"{cfg.num_generations} (GRPO compares completions of the same prompt)")
    errors += [f"rlhf.{k}: only used by algorithm grpo (algorithm is {cfg.algorithm})"
               for k in GRPO_ONLY if k in set_keys and cfg.algorithm != "grpo"]
    errors += [f"rlhf.{k}: only used by algorithm dpo (algorithm is {cfg.algorithm})"
               for k in DPO_ONLY if k in set_keys and cfg.algorithm != "dpo"]
    if cfg.reference_model and not (Path(cfg.reference_model) / "config.json").exists():
        errors.append(f"rlhf.reference_model: {cfg.reference_model} is not an HF checkpoint folder (no config.json)")
    seq = pipeline.model.seq_length if pipeline is not None else None
    if cfg.max_seq_length and seq and cfg.max_seq_length > seq:
        errors.append(f"rlhf.max_seq_length {cfg.max_seq_length} exceeds model.seq_length {seq}")
    runtimes = getattr(pipeline, "runtimes", None) or {}
    if resolve_backend(cfg, runtimes) == "nemo_rl":
        errors += nemo_rl_errors(cfg, nemo_rl_runtime(runtimes), host=False)  # tools: host_errors
    return errors
