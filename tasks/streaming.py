"""Glue between a launched worker and the trackers: log lines → Prefect logs, metrics → MLflow, progress → Prefect."""
from __future__ import annotations

import logging
import sys
import time

from tasks import launch, tracking

_sinks: dict[str, tracking.MetricSink] = {}


def sink_for(run_id: str | None) -> tracking.MetricSink | None:
    if not run_id:
        return None
    if run_id not in _sinks:
        _sinks[run_id] = tracking.MetricSink(tracking.client(), run_id)
    return _sinks[run_id]


def pop_sink(run_id: str | None) -> tracking.MetricSink | None:
    return _sinks.pop(run_id, None) if run_id else None


def _logger():
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:  # outside a flow or task run
        return logging.getLogger("baton")


class _Progress:
    """A Prefect progress artifact per training stage, plus a one-line bar on the terminal."""

    def __init__(self, stage: str):
        self.stage, self.artifact_id, self.last = stage, None, 0.0

    def update(self, step: int, total: int) -> None:
        pct = 100.0 * step / max(total, 1)
        now = time.time()
        if step < total and now - self.last < 1.0:
            return
        self.last = now
        bar = "#" * int(pct // 5)
        sys.stderr.write(f"\r[{self.stage}] [{bar:<20}] {step}/{total} ({pct:.0f}%)" + ("\n" if step >= total else ""))
        sys.stderr.flush()
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact
            from prefect.context import FlowRunContext, TaskRunContext

            if FlowRunContext.get() is None and TaskRunContext.get() is None:
                return  # outside a run an artifact would start a temporary Prefect server (~20 s)
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=pct, key=f"{self.stage}-progress", description=f"{self.stage} training progress")
            else:
                update_progress_artifact(self.artifact_id, progress=pct)
        except Exception:
            pass  # no Prefect context (e.g. `baton convert` run alone)


def launch_streaming(ctx, cmd, *, name: str, env: dict, timeout: float | None, cwd=None) -> launch.LaunchResult:
    logger = _logger()
    sink = sink_for(ctx.mlflow_run_id)
    progress = _Progress(ctx.stage)

    def on_event(e: dict) -> None:
        if e["kind"] == "metric" and sink is not None:
            step = e.get("step", 0)
            sink.add(step, {k: v for k, v in e.items() if k not in ("kind", "step") and isinstance(v, (int, float))})
        elif e["kind"] == "progress":
            progress.update(int(e["step"]), int(e["total"]))

    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        return launch.run(cmd, env=env, cwd=cwd, timeout=timeout, name=name, on_event=on_event,
                          on_line=lambda line: logger.info("[%s] %s", name, line),
                          log_path=ctx.work_dir / "engine.log")
    finally:
        if sink is not None:
            sink.flush()
