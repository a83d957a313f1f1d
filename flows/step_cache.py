"""Whether a step runs or is reused: a completed record of its fingerprint whose output still verifies is reused;
otherwise why it runs (against the last completed facts of its label), and the work dir it runs in (an interrupted
attempt's, so the engine resumes)."""
from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger

from conversions import verify
from flows import chain_planner as planning
from flows.chain_planner import Step
from flows.config import PipelineConfig
from flows.runs import Index
from flows.step_entry import RunInfo
from tasks import streaming
from tasks.stage import Reason, Status, Why


def cached_record(index: Index, step: Step) -> dict | None:
    rec = index.get(step.fingerprint)
    if not rec or rec.get("status") != Status.COMPLETED:
        return None
    side = [s["output"] for s in ((rec.get("entry") or {}).get("side_outputs") or {}).values()]
    for out in filter(None, [rec.get("output"), *side]):
        if not Path(out).exists():
            return None
        if not all(c["passed"] for c in verify.integrity(Path(out))):  # changed on disk since: run again
            return None
    return rec


def _registered(entry: dict) -> bool:
    sides = (entry.get("side_outputs") or {}).values()
    return bool(entry.get("registered")) or any(s.get("registered") for s in sides)


RESUMABLE = (Status.RUNNING, Status.FAILED, Status.CANCELLED)  # index states whose work dir a new attempt resumes from


def step_work_dir(index: Index, step: Step, run: RunInfo, position: int) -> Path:
    """A new folder in this run, or the folder of an interrupted earlier attempt (so the engine resumes)."""
    link = run.run_dir / f"{position:02d}-{step.label}"
    rec = index.get(step.fingerprint)  # read under the step's lock: its owner, if any, is dead
    if (rec and rec.get("status") in RESUMABLE and rec.get("work_dir") and Path(rec["work_dir"]).exists()
            and not _registered(rec.get("entry") or {})):
        old = Path(rec["work_dir"])
        if old != link:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(old, target_is_directory=True)
        return old
    link.mkdir(parents=True, exist_ok=True)
    return link


def why_run(index: Index, cfg: PipelineConfig, step: Step, use_cache: bool) -> list[dict]:
    last = index.last(cfg.name, step.label) or {}
    return [r.to_dict() for r in planning.why_run(step, index.get(step.fingerprint), last.get("facts"), use_cache)]


def remember(index: Index, cfg: PipelineConfig, step: Step) -> None:
    """This step's facts as the last completed ones of its label under this config: what the next run compares with."""
    if step.facts:
        index.put_last(cfg.name, step.label, step.fingerprint, step.facts)


def reuse(rec: dict, entry: dict) -> dict:
    get_run_logger().info("=== %s: unchanged code, inputs and config; reusing %s ===", entry["label"], rec.get("output"))
    cached = dict(rec["entry"])
    cached.update(status=Status.CACHED, prefect_flow_run_id=entry["prefect_flow_run_id"], cached_from=rec.get("run_id"),
                  reason=[Reason(Why.CACHED).to_dict()])
    streaming.step_finished(entry["label"], cached)
    return cached
