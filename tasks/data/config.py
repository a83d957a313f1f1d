from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tasks.data.synthetic import BY_HEART_FRACTION
from tasks.problems import ConfigProblem
from tasks.stage import StrictModel, one_or_list


Format = Literal["auto", "text", "alpaca", "prompt_completion", "messages", "sharegpt", "preference",
                 "implicit_preference", "prompt_answer"]
DATASETS = ("pretrain", "preference", "sft", "prompts")  # prompts: only when data.prompts is set


class SourceConfig(StrictModel):
    """Where one dataset comes from: baton's synthetic generator, local files (jsonl/json/parquet, .txt/.md for
    pretraining), or a hub dataset; and its format (detected from the columns unless declared)."""

    kind: Literal["synthetic", "files", "hub"] = Field(
        "synthetic", description="synthetic: baton's generator; files: local files; hub: a Hugging Face dataset")
    train: str | None = Field(None, description="files: path, glob or folder; hub: dataset id")
    heldout: str | None = Field(None, description="files: path, glob or folder; hub: split name (else split off the "
                                                  "training rows)")
    split: str = Field("train", description="hub: training split")
    name: str | None = Field(None, description="hub: the dataset's config name")
    revision: str | None = Field(None, description="hub: a branch, tag or commit to pin")
    format: Format = Field("auto", description="auto: detected from the columns (tasks/data/formats.py)")
    columns: dict[str, str] = Field(default_factory=dict, description="canonical field → column name in the files")
    max_rows: int | None = Field(None, ge=1, description="take at most this many valid training rows from this "
                                                         "source (in file order, before any held-out split)")
    task: Literal["default", "instruction", "calculator"] = Field(
        "default", description="synthetic: the generated task. default: the tiny world (data.prompts: '3+4=' over the "
                               "sums below 10, which the synthetic pretraining text then states); instruction "
                               "(data.prompts): 'What is 3 + 4?' after a system message asking for the number only, "
                               "over every pair of digits (40 of 100 held out), for an instruction-tuned model "
                               "(--from); calculator (data.sft, data.prompts): products of two two-digit numbers, the "
                               "SFT episodes calling the calculator tool (rlhf.tools)")
    by_heart: float | None = Field(
        None, ge=0, le=1, description="synthetic task calculator, data.sft: the share of SFT conversations answered "
                                      f"without the tool, restating the question (default {BY_HEART_FRACTION})")

    @model_validator(mode="after")
    def _needs_train(self):
        if self.kind != "synthetic" and not self.train:
            raise ValueError(f"source kind '{self.kind}' needs 'train'")
        return self


class DataConfig(StrictModel):
    seed: int = Field(0, description="seed of the synthetic generator and of the held-out split")
    pretrain_docs: int = Field(3000, ge=10, description="synthetic pretraining documents")
    preference_pairs: int = Field(400, ge=10, description="synthetic preference pairs")
    sft_examples: int = Field(600, ge=10, description="synthetic instruction examples")
    arithmetic_prompts: int = Field(400, ge=10, description="synthetic prompts with answers (data.prompts "
                                                            "synthetic): sums like '3+4=' → '7'")
    heldout_fraction: float = Field(0.15, gt=0, lt=0.9, description="rows held out (seeded) from a source without "
                                                                   "heldout")
    label_noise: float = Field(0.0, ge=0, le=1, description="fraction of fine-tuning answers given a wrong category")
    max_bad_fraction: float = Field(0.0, ge=0, le=1, description="bad rows tolerated (skipped, counted) per split")
    tokenizer: Literal["auto", "model", "train"] = Field(
        "auto", description="auto: the input HF checkpoint's tokenizer when the run starts from one (--from), else "
                            "train a byte-level BPE; model: require the checkpoint's; train: always a new BPE")
    revision: str = Field("v1", description="bump to mark a new data revision (scheduled retraining watches the "
                                            "digest)")
    # one source, or a list of sources mixed into one dataset (each with its own format, columns and max_rows)
    pretrain: one_or_list(SourceConfig) = Field(SourceConfig(), description="pretraining text: one source or a list")
    preference: one_or_list(SourceConfig) = Field(SourceConfig(), description="preference pairs: one source or a list")
    sft: one_or_list(SourceConfig) = Field(SourceConfig(), description="instruction data: one source or a list")
    prompts: one_or_list(SourceConfig) | None = Field(
        None, description="prompts with reference answers for rlhf.rewards (GRPO): one source or a list; unset: none "
                          "are made")

    def sources(self, kind: str) -> list[tuple[str, SourceConfig]]:
        """(config key, source) of every source of one dataset: `data.sft` for one, `data.sft[1]` in a list."""
        value = getattr(self, kind)
        if value is None:  # an optional dataset (prompts) not asked for
            return []
        if isinstance(value, SourceConfig):
            return [(f"data.{kind}", value)]
        return [(f"data.{kind}[{i}]", src) for i, src in enumerate(value)]

    def backend(self) -> str:
        """'synthetic' when every dataset is baton's generator, else where the others come from (files, hub)."""
        kinds = {src.kind for k in DATASETS for _, src in self.sources(k)} - {"synthetic"}
        return "+".join(sorted(kinds)) or "synthetic"


def validate(cfg: DataConfig, pipeline=None) -> list[ConfigProblem]:
    """Before anything launches: a list is not empty, synthetic stands alone, declared formats fit the dataset."""
    from tasks.data import formats

    errors = []
    for kind in DATASETS:
        listed = cfg.sources(kind)
        if isinstance(getattr(cfg, kind), list) and not listed:
            errors.append(ConfigProblem(f"data.{kind}", f"data.{kind}: an empty list of sources (give one source, or "
                                        "several)"))
        if len(listed) > 1 and any(src.kind == "synthetic" for _, src in listed):
            errors.append(ConfigProblem(f"data.{kind}", f"data.{kind}: a synthetic source cannot be mixed with "
                                        f"others (its size is data.{_SYNTHETIC_SIZE[kind]} and its gates are the "
                                        "synthetic ones); list only files and hub sources, or use synthetic alone"))
        for key, src in listed:
            if src.kind == "synthetic" and src.max_rows is not None:
                errors.append(ConfigProblem(f"{key}.max_rows", f"{key}.max_rows: applies to files and hub sources; a "
                                            f"synthetic dataset's size is data.{_SYNTHETIC_SIZE[kind]}"))
            if src.task != "default" and (src.kind != "synthetic" or kind not in TASK_DATASETS[src.task]):
                errors.append(ConfigProblem(f"{key}.task", f"{key}.task: {src.task!r} is a synthetic task of "
                                            f"{' and '.join(f'data.{k}' for k in TASK_DATASETS[src.task])} only"))
            if src.by_heart is not None and (src.task != "calculator" or kind != "sft"):
                errors.append(ConfigProblem(f"{key}.by_heart", f"{key}.by_heart: applies to data.sft with task: "
                                            "calculator only"))
            if src.format != "auto" and formats.kind_of(src.format) != kind:
                errors.append(ConfigProblem(f"{key}.format", f"{key}.format: {src.format!r} is not a {kind} format "
                                            f"({', '.join(formats.FORMATS[kind])})"))
    return errors


TASK_DATASETS = {"calculator": ("sft", "prompts"), "instruction": ("prompts",)}  # the datasets each task makes
_SYNTHETIC_SIZE = {"pretrain": "pretrain_docs", "preference": "preference_pairs", "sft": "sft_examples",
                   "prompts": "arithmetic_prompts"}
