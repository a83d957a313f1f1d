from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.stage import StrictModel


class SourceConfig(StrictModel):
    """Where one dataset comes from: baton's synthetic generator, local files (jsonl/parquet/text), or a hub id."""

    kind: Literal["synthetic", "files", "hub"] = "synthetic"
    train: str | None = None          # files: path or glob; hub: dataset id
    heldout: str | None = None        # files: path or glob; hub: split name
    split: str = "train"              # hub: training split

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
    revision: str = "v1"              # bump to mark a new data revision (scheduled retraining watches the digest)
    pretrain: SourceConfig = SourceConfig()
    preference: SourceConfig = SourceConfig()
    sft: SourceConfig = SourceConfig()
