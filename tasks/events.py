"""Structured lines a worker prints so the launcher can stream them into MLflow and Prefect.

    @@baton {"kind": "metric", "step": 3, "loss": 2.31, "lr": 0.001}
    @@baton {"kind": "progress", "step": 3, "total": 100}
    @@baton {"kind": "result", ...}            (final facts the stage task reads back)

Plain lines are ordinary logs. Only rank 0 should emit events in a distributed job.
"""
from __future__ import annotations

import json
import math
import sys

PREFIX = "@@baton "


def emit(kind: str, **fields) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in fields.items()}
    sys.stdout.write(PREFIX + json.dumps({"kind": kind, **clean}, default=str) + "\n")
    sys.stdout.flush()


def metric(step: int, **values) -> None:
    emit("metric", step=step, **{k: float(v) for k, v in values.items()})


def progress(step: int, total: int) -> None:
    emit("progress", step=step, total=total)


def parse(line: str) -> dict | None:
    if not line.startswith(PREFIX):
        return None
    try:
        event = json.loads(line[len(PREFIX):])
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "kind" in event else None
