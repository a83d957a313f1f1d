"""A step's summary entry and what carries it: the entry a step starts with, StageFailed (a failed step with its
entry, for the pipeline's summary) and RunInfo (the run the step belongs to)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect.runtime import flow_run as prefect_flow_run

from flows.chain_planner import Step
from tasks.registry import CONVERT_STAGE
from tasks.stage import Status


class StageFailed(RuntimeError):
    """A failed step; `entry` is its summary entry (status, error, log tail), for the pipeline's summary."""

    def __init__(self, message: str, entry: dict | None = None):
        super().__init__(message)
        self.entry = entry

    def __reduce__(self):  # Prefect may hand the exception back through its result store
        return type(self), (str(self), self.entry)


@dataclass
class RunInfo:
    run_id: str
    run_dir: Path
    mlflow_parent: str | None
    prefect_flow_run_id: str | None


def new_entry(step: Step) -> dict:
    entry = {"name": step.name, "label": step.label, "status": Status.RUNNING, "fingerprint": step.fingerprint,
             "implicit": step.implicit, "prefect_flow_run_id": prefect_flow_run.get_id()}
    if step.name == CONVERT_STAGE:
        entry.update(step.extra)
    return entry
