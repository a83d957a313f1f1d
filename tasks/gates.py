"""The gate a training stage must pass on held-out data: one metric, before (the input checkpoint) and after.

    gate: {metric: heldout_loss, min_improvement: 0.0}

heldout_loss      mean cross-entropy on answer tokens only (lower is better): the default for files and hub data
exact_match       greedy final reply == reference (finetune; the synthetic default)
preference_accuracy  chosen scored above rejected (rlhf; the synthetic default; must not fall)
The stage passes when the metric improves by more than `min_improvement` (preference_accuracy: by at least it).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.stage import StrictModel

LOWER_IS_BETTER = {"heldout_loss"}
AT_LEAST = {"preference_accuracy"}  # historical rlhf rule: must not fall

GateMetric = Literal["auto", "heldout_loss", "exact_match", "preference_accuracy"]


class GateConfig(StrictModel):
    metric: GateMetric = Field("auto", description="auto: heldout_loss for files/hub data, the stage's synthetic "
                                                   "metric (finetune exact_match, rlhf preference_accuracy) otherwise")
    min_improvement: float = Field(0.0, ge=0, description="required improvement over the input checkpoint")


def data_source(data_dir, kind: str) -> str:
    """Where the data stage got a dataset: 'synthetic', 'files' or 'hub' (its manifest records it)."""
    from pathlib import Path

    from conversions import manifest as mf

    m = (mf.read(Path(data_dir)) if data_dir else None) or {}
    return ((m.get("extra") or {}).get("datasets") or {}).get(kind, {}).get("source", "synthetic")


def resolve_metric(gate: GateConfig, data_dir, kind: str, synthetic_metric: str) -> str:
    if gate.metric != "auto":
        return gate.metric
    return synthetic_metric if data_source(data_dir, kind) == "synthetic" else "heldout_loss"


def improvement(metric: str, before: float, after: float) -> float:
    return before - after if metric in LOWER_IS_BETTER else after - before


def check(metric: str, before, after, min_improvement: float, name: str | None = None) -> dict:
    from conversions import verify

    name = name or metric
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)):
        return verify.check(f"eval.{name}", False, f"held-out {metric} was not measured ({before} → {after})")
    gain = improvement(metric, before, after)
    ok = gain >= min_improvement if metric in AT_LEAST else gain > min_improvement
    rule = f"{'≥' if metric in AT_LEAST else '>'} {min_improvement}"
    return verify.check(f"eval.{name}", ok, f"held-out {metric} {before:.4f} → {after:.4f} (improvement "
                        f"{gain:+.4f}, needs {rule})" + ("" if ok else ": not better than the input checkpoint"))
