"""One vocabulary for every training stage: a key means the same thing in pretrain, rlhf and finetune.

Each stage's config model derives from `TrainingConfig` and may change a default, never a meaning. Keys that used to
have other names are refused with "renamed to …" (`StrictModel.renamed`), so an old config fails in a second with the fix.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from conversions.probe import DTYPE_OF_PRECISION
from tasks.hardware import resolve_device
from tasks.problems import ConfigProblem
from tasks.stage import StrictModel

Precision = Literal["fp32", "bf16", "fp16"]
LrSchedule = Literal["constant", "cosine", "linear"]
Device = Literal["auto", "cpu", "cuda"]


class TrainingConfig(StrictModel):
    """Keys every training stage shares. Batch sizes: `global_batch_size` = `micro_batch_size` × data-parallel ranks ×
    `gradient_accumulation_steps`; give one of the last two (or neither: one accumulation step), the other is derived."""

    steps: int = Field(60, ge=1, description="optimizer steps")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    micro_batch_size: int = Field(8, ge=1, description="sequences (or pairs) per rank per forward/backward pass")
    global_batch_size: int | None = Field(
        None, ge=1, description="sequences per optimizer step over all data-parallel ranks (default: derived)")
    gradient_accumulation_steps: int | None = Field(
        None, ge=1, description="micro batches per optimizer step and rank (default: derived, else 1)")
    nproc_per_node: int = Field(1, ge=1, description="ranks per node (GPUs, or CPU processes)")
    nnodes: int = Field(1, ge=1, description="nodes")
    max_seq_length: int | None = Field(None, ge=8, description="tokens per training sequence (default: model.seq_length)")
    checkpoint_every: int = Field(20, ge=1, description="steps between checkpoints (the last step always saves)")
    keep_checkpoints: int = Field(2, ge=1, description="newest complete checkpoints kept while training")
    lr_schedule: LrSchedule = Field("cosine", description="learning-rate schedule after the warm-up")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps before the schedule")
    grad_clip: float = Field(1.0, ge=0, description="max global gradient norm; 0 disables clipping")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    precision: Precision = Field("fp32", description="fp32 | bf16 | fp16 (mixed precision on GPU)")
    device: Device = Field("auto", description="auto: cuda when GPUs are visible, else cpu")
    timeout_s: float = Field(3600, gt=0, description="wall-clock limit of the stage's engine")

    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def data_parallel(self) -> int:
        """Ranks that each see different data (stages with model parallelism divide the world by it)."""
        return self.world_size()

    def accumulation(self) -> int:
        if self.gradient_accumulation_steps is not None:
            return self.gradient_accumulation_steps
        if self.global_batch_size is not None:
            return max(1, self.global_batch_size // (self.micro_batch_size * max(1, self.data_parallel())))
        return 1

    def global_batch(self) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        return self.micro_batch_size * max(1, self.data_parallel()) * self.accumulation()

    def resolved_device(self) -> str:
        return resolve_device(self.device)

    def torch_dtype(self) -> str:
        return DTYPE_OF_PRECISION[self.precision]


def batch_errors(cfg: TrainingConfig, section: str) -> list[ConfigProblem]:
    """global = micro × DP × accumulation must hold exactly, whichever of them the config gives."""
    dp = cfg.data_parallel()
    if dp < 1:
        return []
    per_step = cfg.micro_batch_size * dp
    if cfg.global_batch_size is not None and cfg.global_batch_size % per_step:
        return [ConfigProblem(f"{section}.global_batch_size", f"{section}.global_batch_size {cfg.global_batch_size} "
                              f"is not divisible by micro_batch_size {cfg.micro_batch_size} × data parallel {dp} = "
                              f"{per_step}")]
    if (cfg.global_batch_size is not None and cfg.gradient_accumulation_steps is not None
            and cfg.global_batch_size != per_step * cfg.gradient_accumulation_steps):
        return [ConfigProblem(f"{section}.global_batch_size", f"{section}.global_batch_size {cfg.global_batch_size} "
                              f"disagrees with micro_batch_size {cfg.micro_batch_size} × data parallel {dp} × "
                              f"gradient_accumulation_steps {cfg.gradient_accumulation_steps}; give one of the two")]
    return []


def schedule_errors(cfg: TrainingConfig, section: str) -> list[ConfigProblem]:
    if cfg.warmup_steps >= cfg.steps and cfg.lr_schedule != "constant":
        return [ConfigProblem(f"{section}.warmup_steps", f"{section}.warmup_steps {cfg.warmup_steps} leaves no steps "
                              f"for the {cfg.lr_schedule} schedule (steps is {cfg.steps})")]
    return []
