"""Glue between a launched worker and the trackers: log lines → Prefect logs, metrics → MLflow, progress → Prefect,
and step events (started, progress, metric, finished) → whoever watches the run (the CLI's terminal view).

Every step writes its own `step.log` (all log records while it runs: Prefect, baton, engine lines, library warnings);
the terminal view shows only the step events.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
import time
from pathlib import Path
from typing import Protocol

from tasks import launch, tracking

STEP_LOG = "step.log"
ENGINE_WALL = "engine wall time:"  # the line step.log gets when an engine exits 0 (benchmarks/overhead_bench.py)

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


class Observer(Protocol):
    """What a run's watcher hears about each step; the CLI's terminal view is one."""

    def step_started(self, label: str, log_path: Path | None) -> None: ...
    def step_progress(self, label: str, step: int, total: int) -> None: ...
    def step_metric(self, label: str, step: int, values: dict) -> None: ...
    def step_finished(self, label: str, entry: dict, log_path: Path | None) -> None: ...


_observer: Observer | None = None
_current_step: str | None = None


def observe(observer: Observer | None) -> None:
    """Route step events of runs in this process to observer (None: nobody watches)."""
    global _observer
    _observer = observer


def _notify(method: str, *args) -> None:
    if _observer is None:
        return
    try:
        getattr(_observer, method)(*args)
    except Exception:  # a broken view must never fail a run
        logging.getLogger("baton").debug("observer %s failed", method, exc_info=True)


def step_finished(label: str, entry: dict, log_path: Path | None = None) -> None:
    _notify("step_finished", label, entry, log_path)


class _StepLogHandler(logging.FileHandler):
    """Every record that reaches the root logger while a step runs (Prefect's flow/task loggers propagate there)."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8", delay=False)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))


@contextlib.contextmanager
def step_log(label: str, work_dir: Path):
    """While the step runs, its log records go to <work_dir>/step.log and its events to the observer."""
    global _current_step
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / STEP_LOG
    handler = _StepLogHandler(path)
    root = logging.getLogger()
    root.addHandler(handler)
    _current_step = label
    _notify("step_started", label, path)
    try:
        yield path
    finally:
        _current_step = None
        root.removeHandler(handler)
        handler.close()


def tail(path: Path | None, lines: int = 30) -> list[str]:
    """The last lines of a log file (what a person reads first when a step failed)."""
    if path is None or not Path(path).exists():
        return []
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 256 * 1024))
        text = f.read().decode("utf-8", errors="replace")
    return text.splitlines()[-lines:]


class _Progress:
    """A Prefect progress artifact per training stage, and progress events for the terminal view. The artifact is
    posted from a thread of its own: a Prefect server that is gone (its client retries for a minute) never holds up
    the reader of the engine's output, and through its pipe, training."""

    def __init__(self, stage: str):
        self.stage, self.artifact_id, self.last = stage, None, 0.0
        self._posting: threading.Thread | None = None

    def update(self, step: int, total: int) -> None:
        _notify("step_progress", _current_step or self.stage, step, total)
        now = time.time()
        if step < total and now - self.last < 1.0:
            return
        if self._posting is not None and self._posting.is_alive():  # the last one still waits on the server
            return
        self.last = now
        run_context = contextvars.copy_context()  # Prefect's flow/task run context, for the thread
        self._posting = threading.Thread(target=run_context.run, args=(self._post, 100.0 * step / max(total, 1)),
                                         name=f"{self.stage}-progress", daemon=True)
        self._posting.start()

    def _post(self, pct: float) -> None:
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact
            from prefect.context import FlowRunContext, TaskRunContext

            from tasks import orchestration

            if FlowRunContext.get() is None and TaskRunContext.get() is None:
                return  # outside a run an artifact would start a temporary Prefect server (~20 s)
            if orchestration.lost():
                return
            if self.artifact_id is None:
                self.artifact_id = create_progress_artifact(
                    progress=pct, key=f"{self.stage}-progress", description=f"{self.stage} training progress")
            else:
                update_progress_artifact(self.artifact_id, progress=pct)
        except Exception:
            pass  # no Prefect context (e.g. `baton convert` run alone), or its server is gone


def launch_streaming(ctx, cmd, *, name: str, env: dict, timeout: float | None, cwd=None) -> launch.LaunchResult:
    logger = _logger()
    sink = sink_for(ctx.mlflow_run_id)
    progress = _Progress(ctx.stage)

    def on_event(e: dict) -> None:
        if e["kind"] == "metric":
            step = e.get("step", 0)
            values = {k: v for k, v in e.items() if k not in ("kind", "step") and isinstance(v, (int, float))}
            if sink is not None:
                sink.add(step, values)
            _notify("step_metric", _current_step or ctx.stage, step, values)
        elif e["kind"] == "progress":
            progress.update(int(e["step"]), int(e["total"]))

    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    try:
        res = launch.run(cmd, env=env, cwd=cwd, timeout=timeout, name=name, on_event=on_event,
                         on_line=lambda line: logger.info("[%s] %s", name, line),
                         log_path=ctx.work_dir / "engine.log")
    finally:
        if sink is not None:
            sink.flush()  # one try: the stage's end (flows/step_tracking.py) retries, then saves what is left
    logger.info("%s %s", ENGINE_WALL, json.dumps({"name": name, "seconds": round(res.seconds, 3)}))
    return res
