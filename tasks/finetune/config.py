from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from tasks.data.lm_eval_task import TASK_NAME
from tasks.gates import GateConfig, lm_eval_errors
from tasks.problems import ConfigProblem
from tasks.stage import StrictModel
from tasks.vocabulary import TrainingConfig, batch_errors, schedule_errors


class ZeroConfig(StrictModel):
    """DeepSpeed ZeRO partitioning: 1 optimizer states, 2 + gradients, 3 + parameters."""

    stage: int = Field(2, description="ZeRO stage: 1, 2 or 3")
    offload_optimizer: Literal["none", "cpu", "nvme"] = Field(
        "none", description="cpu: ZeRO-Offload; nvme: refused (DeepSpeed's checkpoints then lack the optimizer state)")
    offload_params: Literal["none", "cpu", "nvme"] = Field("none", description="ZeRO-3 only; nvme needs nvme_path")
    nvme_path: str | None = Field(None, description="absolute folder for NVMe offload files (fast local disk)")
    nvme_max_in_cpu: int = Field(
        1_000_000_000, ge=0, description="offload_params nvme: parameter elements DeepSpeed keeps in CPU memory "
                                         "before swapping to nvme_path (its max_in_cpu)")
    nvme_buffer_count: int = Field(
        5, ge=1, description="offload_params nvme: parameter swap buffers per rank (DeepSpeed's offload_param."
                             "buffer_count); raise it when DeepSpeed stops on 'Not enough buffers'")
    nvme_buffer_size: int = Field(
        100_000_000, ge=1, description="offload_params nvme: elements per swap buffer (offload_param.buffer_size); at "
                                       "least the largest parameter partition; count x size x dtype bytes are held")
    quantized_weights: bool = Field(False, description="ZeRO++ qwZ: int8 weight all-gather (ZeRO-3, CUDA only)")
    quantized_gradients: bool = Field(False, description="ZeRO++ qgZ: int4 gradient reduce-scatter (ZeRO-3, CUDA only)")
    hpz_partition_size: int = Field(
        1, ge=1, description="ZeRO++ hpZ: ranks holding a secondary weight copy (ZeRO-3, more than one node; "
                             "usually nproc_per_node)")
    overlap_comm: bool = Field(False, description="overlap gradient communication with the backward pass")
    contiguous_gradients: bool = Field(True, description="copy gradients into one contiguous buffer as produced")
    reduce_bucket_size: int = Field(50_000_000, ge=1, description="elements reduced at a time")
    allgather_bucket_size: int = Field(50_000_000, ge=1, description="ZeRO-1/2")
    prefetch_bucket_size: int = Field(50_000_000, ge=1, description="ZeRO-3")
    init: bool = Field(True, description="ZeRO-3: build the model inside deepspeed.zero.Init() so no rank ever holds "
                                         "the whole model (off: every rank materialises it first)")
    param_persistence_threshold: int = Field(0, ge=0, description="ZeRO-3: smaller params stay unpartitioned")


class LoraConfig(StrictModel):
    """Optional LoRA adapters (peft); the checkpoint keeps them separate, the converter merges them."""

    enabled: bool = Field(False, description="train LoRA adapters instead of every weight")
    r: int = Field(8, ge=1, description="adapter rank")
    alpha: float = Field(16.0, gt=0, description="scaling: the adapters' update is multiplied by alpha / r")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                               "gate_proj", "up_proj", "down_proj"],
                                      description="names of the modules that get adapters")


class FinetuneGateConfig(GateConfig):
    """The stage's quality gate: the held-out metric its output must improve over the input checkpoint's."""

    default_task: ClassVar[str | None] = TASK_NAME  # the data stage's held-out SFT task, which fine-tuning should improve


class FinetuneConfig(TrainingConfig):
    """Supervised fine-tuning with DeepSpeed ZeRO on the data stage's instruction set (loss on answer tokens)."""

    renamed: ClassVar[dict[str, str]] = {
        "processes": "nproc_per_node", "nproc": "nproc_per_node", "learning_rate": "lr", "grad_accum":
        "gradient_accumulation_steps", "max_length": "max_seq_length", "save_interval": "checkpoint_every",
        "clip_grad": "grad_clip", "batch_size": "micro_batch_size"}

    zero: ZeroConfig = ZeroConfig()
    lora: LoraConfig = LoraConfig()
    nproc_per_node: int = Field(2, ge=1, description="data-parallel ranks per node (GPUs, or CPU processes)")
    launcher: Literal["deepspeed", "torchrun"] = Field(
        "deepspeed", description="deepspeed: its launcher (--num_gpus N, also on CPU); torchrun")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward pass (HF gradient checkpointing): "
                           "activations shrink to one layer's input per layer, at about a third more compute")
    micro_batch_size: int = Field(16, ge=1, description="sequences per rank per micro step")
    steps: int = Field(300, ge=1, description="optimizer steps")
    lr: float = Field(3e-3, gt=0, description="peak learning rate")
    optimizer: Literal["torch_adamw", "deepspeed_adamw"] = Field(
        "torch_adamw",
        description="torch AdamW (no JIT build), or DeepSpeed's FusedAdam (DeepSpeedCPUAdam with offload)")
    warmup_steps: int = Field(10, ge=0, description="linear warm-up steps before the schedule")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine: final lr / peak lr")
    checkpoint_every: int = Field(100, ge=1, description="steps between checkpoints (the last step always saves)")
    eval_max_new_tokens: int = Field(16, ge=1, description="greedy tokens generated per held-out prompt "
                                                           "(exact match)")
    gate: FinetuneGateConfig = FinetuneGateConfig()
    overlong: Literal["drop", "truncate"] = Field("drop", description="examples longer than max_seq_length")
    packing: bool = Field(False, description="pack examples into max_seq_length windows (no attention across "
                                             "examples; position ids restart per example): each micro batch row is "
                                             "then a window, so steps cover more examples and no padding is trained")
    log_every: int = Field(1, ge=1, description="steps between metric reports")
    master_port: int = Field(0, ge=0, le=65535, description="0: pick a free port")


def validate(cfg: FinetuneConfig, pipeline=None) -> list[ConfigProblem]:
    """Problems found before anything launches, each naming its key."""
    errors = []
    z = cfg.zero
    if z.stage not in (1, 2, 3):
        errors.append(ConfigProblem("finetune.zero.stage", f"finetune.zero.stage: {z.stage} is not a ZeRO stage (1, "
                                    "2 or 3)"))
    if z.offload_params != "none" and z.stage != 3:
        errors.append(ConfigProblem("finetune.zero.offload_params", "finetune.zero.offload_params: parameter "
                                    f"offload needs ZeRO stage 3 (stage is {z.stage})"))
    errors += offload_errors(cfg) + zero_plus_plus_errors(cfg) + precision_errors(cfg)
    errors += batch_errors(cfg, "finetune") + schedule_errors(cfg, "finetune")
    if cfg.gate.metric in ("preference_accuracy", "heldout_reward"):
        errors.append(ConfigProblem("finetune.gate.metric", f"finetune.gate.metric: {cfg.gate.metric} is an rlhf "
                                    "metric (heldout_loss, exact_match or lm_eval)"))
    errors += lm_eval_errors(cfg.gate, "finetune")
    if cfg.lora.enabled and not cfg.lora.target_modules:
        errors.append(ConfigProblem("finetune.lora.target_modules", "finetune.lora.target_modules: empty"))
    if cfg.lora.enabled and pipeline is not None and pipeline.model.moe is not None:
        errors.append(ConfigProblem("finetune.lora.enabled", moe_lora_refusal(
            f"the model is a mixture of experts (model.moe: {pipeline.model.moe.num_experts} experts)"),
            involves=("model.moe",)))
    if pipeline is not None:
        seq = pipeline.model.seq_length
        if cfg.max_seq_length is not None and not 8 <= cfg.max_seq_length <= seq:
            errors.append(ConfigProblem("finetune.max_seq_length", f"finetune.max_seq_length: {cfg.max_seq_length} "
                                        f"must be between 8 and model.seq_length {seq}"))
    elif cfg.max_seq_length is not None and cfg.max_seq_length < 8:
        errors.append(ConfigProblem("finetune.max_seq_length", f"finetune.max_seq_length: {cfg.max_seq_length} is "
                                    "below 8"))
    return errors


def moe_lora_refusal(what: str) -> str:
    """LoRA on a mixture of experts is refused: transformers keeps a layer's experts as fused 3-D parameters, which
    peft's target_modules (Linear modules) cannot reach, so the adapters would miss every expert. peft's
    target_parameters reaches them (tried with peft 0.21 in memory), but the ZeRO → HF merge does not read those
    adapters yet (docs/moe.md)."""
    return (f"finetune.lora.enabled: {what}; transformers holds its experts as fused 3-D parameters, which peft's "
            "target_modules (Linear modules only) cannot reach, so adapters would train attention and miss every "
            "expert; peft's target_parameters for them is not merged by baton's ZeRO → HF export yet: finetune every "
            "weight (finetune.lora.enabled: false)")


def offload_errors(cfg: FinetuneConfig) -> list[ConfigProblem]:
    """ZeRO-Infinity: NVMe offload is a ZeRO-3 feature and needs a folder for its swap files."""
    z = cfg.zero
    nvme = [k for k in ("offload_optimizer", "offload_params") if getattr(z, k) == "nvme"]
    errors = [f"finetune.zero.{k}: nvme offload needs ZeRO stage 3 (stage is {z.stage})" for k in nvme if z.stage != 3]
    if z.offload_optimizer == "nvme":  # measured on DeepSpeed 0.19.8, see README "Engine options"
        errors.append(ConfigProblem("finetune.zero.offload_optimizer", "finetune.zero.offload_optimizer: nvme is "
                                    "refused: DeepSpeed writes no fp32 master weights or Adam state into its "
                                    "checkpoints while they are swapped to NVMe (empty partitions), so neither "
                                    "resume nor conversion could recover the training; use offload_optimizer: cpu "
                                    "with offload_params: nvme"))
    if nvme and not z.nvme_path:
        errors.append(ConfigProblem("finetune.zero.nvme_path", "finetune.zero.nvme_path: required by "
                                    f"zero.{nvme[0]}: nvme"))
    if z.nvme_path is not None:
        if not nvme:
            errors.append(ConfigProblem("finetune.zero.nvme_path", "finetune.zero.nvme_path: set, but neither "
                                        "offload_optimizer nor offload_params is nvme"))
        elif not Path(z.nvme_path).is_absolute():
            errors.append(ConfigProblem("finetune.zero.nvme_path", f"finetune.zero.nvme_path: {z.nvme_path!r} is not "
                                        "an absolute path"))
    return errors


def precision_errors(cfg: FinetuneConfig) -> list[ConfigProblem]:
    """DeepSpeed's CPU accelerator trains in fp32 and bf16 only: fp16 stops in the engine's start-up ("Type fp16 is not
    supported on your device"), after the launch; say so before it."""
    device = cfg.resolved_device()
    if cfg.precision == "fp16" and device != "cuda":
        return [ConfigProblem("finetune.precision", f"finetune.precision fp16: refused on {device}: DeepSpeed's CPU "
                              "accelerator has no fp16 (use bf16 or fp32, or a GPU)")]
    return []


def zero_plus_plus_errors(cfg: FinetuneConfig) -> list[ConfigProblem]:
    """ZeRO++ (qwZ, qgZ, hpZ) extends ZeRO-3; its quantizers are CUDA kernels, and hpZ's secondary copy only saves
    traffic when it spans fewer ranks than the whole world (one node of several)."""
    z = cfg.zero
    errors = []
    quantized = [k for k in ("quantized_weights", "quantized_gradients") if getattr(z, k)]
    used = quantized + (["hpz_partition_size"] if z.hpz_partition_size > 1 else [])
    errors += [ConfigProblem(f"finetune.zero.{k}", f"finetune.zero.{k}: ZeRO++ needs ZeRO stage 3 (stage is "
                             f"{z.stage})") for k in used if z.stage != 3]
    device = cfg.resolved_device()
    errors += [ConfigProblem(f"finetune.zero.{k}", f"finetune.zero.{k}: refused on {device}: ZeRO++ quantization "
                             "runs DeepSpeed's CUDA quantizer kernels (needs device cuda)")
               for k in quantized if device != "cuda"]
    if z.hpz_partition_size > 1:
        if cfg.nnodes < 2:
            errors.append(ConfigProblem("finetune.zero.hpz_partition_size", "finetune.zero.hpz_partition_size "
                                        f"{z.hpz_partition_size}: hpZ needs more than one node (nnodes is "
                                        f"{cfg.nnodes}); on one node it only duplicates the ZeRO-3 partitions"))
        elif cfg.nproc_per_node % z.hpz_partition_size:
            errors.append(ConfigProblem("finetune.zero.hpz_partition_size", "finetune.zero.hpz_partition_size "
                                        f"{z.hpz_partition_size}: must divide nproc_per_node {cfg.nproc_per_node} "
                                        "(the secondary partition stays inside a node)"))
    return errors
