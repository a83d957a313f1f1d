from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.stage import StrictModel


Format = Literal["auto", "text", "alpaca", "prompt_completion", "messages", "sharegpt", "preference",
                 "implicit_preference"]


class SourceConfig(StrictModel):
    """Where one dataset comes from: baton's synthetic generator, local files (jsonl/json/parquet, .txt/.md for
    pretraining), or a hub dataset; and its format (detected from the columns unless declared)."""

    kind: Literal["synthetic", "files", "hub"] = "synthetic"
    train: str | None = None          # files: path, glob or folder; hub: dataset id
    heldout: str | None = None        # files: path, glob or folder; hub: split name (else split off the training rows)
    split: str = "train"              # hub: training split
    name: str | None = Field(None, description="hub: the dataset's config name")
    revision: str | None = Field(None, description="hub: a branch, tag or commit to pin")
    format: Format = Field("auto", description="auto: detected from the columns (tasks/data/formats.py)")
    columns: dict[str, str] = Field(default_factory=dict, description="canonical field → column name in the files")

    @model_validator(mode="after")
    def _needs_train(self):
        if self.kind != "synthetic" and not self.train:
            raise ValueError(f"source kind '{self.kind}' needs 'train'")
        return self


class DataConfig(StrictModel):
    seed: int = 0
    pretrain_docs: int = Field(3000, ge=10)
    preference_pairs: int = Field(400, ge=10)
    sft_examples: int = Field(600, ge=10)
    heldout_fraction: float = Field(0.15, gt=0, lt=0.9)
    label_noise: float = Field(0.0, ge=0, le=1, description="fraction of fine-tuning answers given a wrong category")
    max_bad_fraction: float = Field(0.0, ge=0, le=1, description="bad rows tolerated (skipped, counted) per split")
    tokenizer: Literal["auto", "model", "train"] = Field(
        "auto", description="auto: the input HF checkpoint's tokenizer when the run starts from one (--from), else "
                            "train a byte-level BPE; model: require the checkpoint's; train: always a new BPE")
    revision: str = "v1"              # bump to mark a new data revision (scheduled retraining watches the digest)
    pretrain: SourceConfig = SourceConfig()
    preference: SourceConfig = SourceConfig()
    sft: SourceConfig = SourceConfig()
