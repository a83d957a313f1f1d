from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.stage import StrictModel


class NemoRlConfig(StrictModel):
    """How the nemo_rl backend runs. Where NeMo-RL lives (checkout path, container image, Slurm) is the runtime
    `runtimes.nemo_rl` (kind venv = a checkout at `path`; container = `image`; slurm = `ray.sub` in `path`)."""

    gpus_per_node: int = Field(8, ge=1)     # nodes: runtimes.nemo_rl.nodes
    precision: Literal["bfloat16", "float32"] = "bfloat16"
    micro_batch_size: int = Field(1, ge=1)
    slurm_account: str | None = None
    slurm_partition: str | None = None
    slurm_time: str = "4:0:0"
    overrides: list[str] = Field(default_factory=list, description="extra NeMo-RL key=value overrides, passed last")


class RlhfConfig(StrictModel):
    """Preference optimisation of the input HF checkpoint on the data stage's preference pairs."""

    backend: Literal["auto", "trl", "nemo_rl"] = Field(
        "auto", description="auto: nemo_rl when a GPU and a NeMo-RL runtime are present, else trl")
    algorithm: Literal["dpo", "rm", "grpo"] = "dpo"
    steps: int = Field(60, ge=1, description="optimizer steps")
    batch_size: int = Field(32, ge=1, description="pairs (dpo, rm) or completions (grpo) per step and process; "
                            "nemo_rl: batch_size x grad_accum is the global batch")
    grad_accum: int = Field(1, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    beta: float = Field(0.1, description="dpo: preference temperature (> 0); grpo: KL penalty to the reference (>= 0)")
    sft_weight: float = Field(
        1.0, ge=0, description="dpo: weight of an SFT loss on the chosen replies added to the DPO loss (RPO; NeMo-RL "
                               "dpo.sft_loss_weight); keeps a model new to the chat format generating replies")
    max_length: int | None = Field(None, ge=8, description="prompt + completion tokens (default: model seq_length)")
    reference: Literal["copy", "precomputed"] = Field(
        "copy", description="dpo reference: a frozen copy of the input in memory, or its log-probs precomputed once")
    reference_model: str | None = Field(None, description="another HF checkpoint folder as the dpo reference")
    num_generations: int = Field(4, ge=2, description="grpo: completions sampled per prompt")
    max_completion_length: int = Field(16, ge=1, description="grpo: new tokens per completion")
    nproc: int = Field(1, ge=1, le=8, description="trl: CPU processes (torchrun, gloo) when > 1")
    timeout_s: float = Field(3600, gt=0)
    nemo_rl: NemoRlConfig = NemoRlConfig()
