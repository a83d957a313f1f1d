from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tasks.gates import GateConfig
from tasks.stage import StrictModel
from tasks.vocabulary import Precision, TrainingConfig


class NemoRlConfig(StrictModel):
    """How the nemo_rl backend runs. Where NeMo-RL lives (checkout path, container image, Slurm) is the runtime
    `runtimes.nemo_rl` (kind venv = a checkout at `path`; container = `image`; slurm = `ray.sub` in `path`)."""

    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (nodes: runtimes.nemo_rl.nodes)")
    precision: Precision = Field("bf16", description="NeMo-RL's training precision")
    micro_batch_size: int = Field(1, ge=1, description="NeMo-RL's own micro batch per GPU")
    slurm_account: str | None = Field(None, description="slurm: the job's account")
    slurm_partition: str | None = Field(None, description="slurm: the job's partition")
    slurm_time: str = Field("4:0:0", description="slurm: the job's time limit")
    overrides: list[str] = Field(default_factory=list, description="extra NeMo-RL key=value overrides, passed last")


class RlhfConfig(TrainingConfig):
    """Preference optimisation of the input HF checkpoint on the data stage's preference pairs. nemo_rl: the global
    batch is micro_batch_size × gradient_accumulation_steps (its own micro batch is nemo_rl.micro_batch_size)."""

    renamed: ClassVar[dict[str, str]] = {
        "batch_size": "micro_batch_size", "grad_accum": "gradient_accumulation_steps", "learning_rate": "lr",
        "max_length": "max_seq_length", "nproc": "nproc_per_node", "processes": "nproc_per_node"}

    backend: Literal["auto", "trl", "nemo_rl"] = Field(
        "auto", description="auto: nemo_rl when a GPU and a NeMo-RL runtime are present, else trl")
    algorithm: Literal["dpo", "rm", "grpo"] = Field(
        "dpo", description="dpo: DPO plus an SFT loss on the chosen replies; rm: a reward model saved beside, the "
                           "policy unchanged; grpo: reward from the preference data")
    micro_batch_size: int = Field(32, ge=1, description="pairs (dpo, rm) or completions (grpo) per step and process")
    nproc_per_node: int = Field(1, ge=1, le=8, description="trl: CPU processes (torchrun, gloo) when > 1")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="learning-rate schedule "
                                                                                          "after the warm-up")
    beta: float = Field(0.1, description="dpo: preference temperature (> 0); grpo: KL penalty to the reference (>= 0)")
    sft_weight: float = Field(
        1.0, ge=0, description="dpo: weight of an SFT loss on the chosen replies added to the DPO loss (RPO; NeMo-RL "
                               "dpo.sft_loss_weight); keeps a model new to the chat format generating replies")
    reference: Literal["copy", "precomputed"] = Field(
        "copy", description="dpo reference: a frozen copy of the input in memory, or its log-probs precomputed once")
    reference_model: str | None = Field(None, description="another HF checkpoint folder as the dpo reference")
    num_generations: int = Field(4, ge=2, description="grpo: completions sampled per prompt")
    max_completion_length: int = Field(16, ge=1, description="grpo: new tokens per completion")
    dataloader_workers: int = Field(0, ge=0, description="trl: data-loader worker processes per rank (each copies "
                                                      "the dataset; above ~8 CPU RAM blows up)")
    gate: GateConfig = GateConfig()
    overlong: Literal["drop", "truncate"] = Field("drop", description="pairs longer than max_seq_length")
    nemo_rl: NemoRlConfig = NemoRlConfig()
