"""The step runner: each step the chain planner made (a stage or a conversion) runs as a Prefect subflow (STAGE_FLOWS,
one per stage). It runs the stage's task inside an MLflow child run, applies the gate, and registers the checkpoint
(alias `candidate`) only when the gate passed. A failed gate fails the step: nothing is promoted. What it runs, one
concern a module: step_cache (run or reuse), step_retries (which engine failures are retried), step_gate (the gate),
step_tracking (MLflow, the registry), step_entry (the summary entry and StageFailed)."""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from conversions.refusal import Refused
from flows.chain_planner import Step
from flows.config import PipelineConfig
from flows.runs import Index, StepLock
from flows.step_cache import cached_record, remember, reuse, step_work_dir, why_run
from flows.step_entry import RunInfo, StageFailed, new_entry
from flows.step_gate import apply_gate, with_finite_check, with_serving_contract_check
from flows.step_retries import run_with_retries
from flows.step_tracking import (close_dead_attempt, close_stage_run, memory_vs_plan, record_output,
                                 register_outputs, start_stage_run)
from tasks import chat_template, orchestration, streaming, tracking
from tasks.launch import LaunchError
from tasks import memory_plan as mp
from tasks.registry import CONVERT_STAGE, STAGES, TRAINING_STAGES
from tasks.stage import Failure, StageContext, Status, reasons_text


def disk_needed(cfg: PipelineConfig, step: Step) -> int:
    """Bytes a step will write (tasks/memory_plan.py: the one table of bytes per parameter); a conversion writes the
    weights once more."""
    if step.name in TRAINING_STAGES:
        return mp.stage_disk_bytes(cfg, step.name)
    if step.name == CONVERT_STAGE:
        return mp.shape_of_model(cfg.model).params() * mp.HF_BYTES_PER_PARAM
    return 0


def check_free_space(cfg: PipelineConfig, step: Step, work: Path) -> None:
    from conversions import durable

    if problem := durable.free_space_problem(work, disk_needed(cfg, step)):
        raise StageFailed(f"{step.label}: {problem}; not started",
                          {**new_entry(step), "status": Status.FAILED, "error": problem, "failure": Failure.NO_ROOM})


def _context(cfg: PipelineConfig, step: Step, run: RunInfo, work: Path, mlflow_run: str, input_path: str | None,
             input_format: str | None, data_dir: str | None) -> StageContext:
    return StageContext(
        stage=step.name, run_id=run.run_id, run_dir=run.run_dir, work_dir=work,
        model=chat_template.resolved(cfg.model.model_dump()),
        seed=cfg.seed, data_dir=Path(data_dir) if data_dir else None, input=Path(input_path) if input_path else None,
        input_format=input_format, runtimes=cfg.engine_runtimes(),
        mlflow_run_id=mlflow_run, tracking=cfg.tracking.model_dump(), extra=dict(step.extra))


def stopped_from_outside(e: BaseException) -> bool:
    """Prefect's cancellation (its SIGTERM arrives as TerminationSignal), any other SIGTERM, or Ctrl-C: the step was
    stopped, it did not fail."""
    from prefect.exceptions import TerminationSignal

    return isinstance(e, (TerminationSignal, KeyboardInterrupt))


def describe_stop(e: BaseException) -> str:
    import signal

    if isinstance(e, KeyboardInterrupt):
        return "cancelled (interrupted, Ctrl-C)"
    number = getattr(e, "signal", None)
    name = signal.Signals(number).name if number in set(signal.Signals) else f"signal {number}"
    return f"cancelled ({name}: Prefect's cancellation or a stop of the process)"


def _failure(step: Step, entry: dict, e: Exception) -> StageFailed:
    """The summary entry of a stage that raised, inside the exception the pipeline catches."""
    if isinstance(e, StageFailed):
        return e
    if isinstance(e, LaunchError):
        entry.update(status=Status.FAILED, error=str(e).splitlines()[0], log_tail=e.tail[-20:], failure=Failure.ENGINE)
        return StageFailed(f"{step.label}: {e}", entry)
    if isinstance(e, Refused):  # expected: the user's input, named in one line; no traceback of baton's frames
        entry.update(status=Status.FAILED, error=str(e), failure=Failure.REFUSED)
        get_run_logger().error("%s refused: %s", step.label, e)
        return StageFailed(f"{step.label}: {e}", entry)
    entry.update(status=Status.FAILED, error=f"{type(e).__name__}: {e}", failure=Failure.BUG)
    get_run_logger().error("%s failed:\n%s", step.label, traceback.format_exc())
    return StageFailed(f"{step.label}: {type(e).__name__}: {e}", entry)


def execute_step(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
                 input_format: str | None, data_dir: str | None, use_cache: bool = True) -> dict:
    """Run one step (or reuse it) under its fingerprint's lock: a second run of the same step waits for the first
    (BATON_NO_WAIT=1 refuses instead, naming the owner) and then reuses its result."""
    wait = os.environ.get("BATON_NO_WAIT", "") not in ("1", "true")
    with StepLock(step.fingerprint, step.label).acquire(run.run_id, wait=wait) as lock:
        close_dead_attempt((lock.dead_owner or {}).get("run_id"), step, run)
        return _execute_locked(step, cfg, run, position, input_path, input_format, data_dir, use_cache)


def _execute_locked(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
                    input_format: str | None, data_dir: str | None, use_cache: bool) -> dict:
    """Run one step (or reuse it), gate it, register what passed; a failure raises StageFailed carrying its entry."""
    index = Index()
    entry = new_entry(step)
    if use_cache and STAGES[step.name].cacheable and (rec := cached_record(index, step)) is not None:
        remember(index, cfg, step)
        return reuse(rec, entry)
    entry["reason"] = why_run(index, cfg, step, use_cache)
    get_run_logger().info("=== stage %s (%s): %s ===", step.label, STAGES[step.name].description,
                          reasons_text(entry["reason"]))
    check_free_space(cfg, step, run.run_dir)
    c, missing = tracking.client(), []  # missing: what the tracking server did not get (it was unreachable)
    mlflow_run = entry["mlflow_run_id"] = start_stage_run(c, cfg, step, run, entry, missing)
    monitor = tracking.system_metrics(mlflow_run) if mlflow_run else None
    work = step_work_dir(index, step, run, position)
    index.put(step.fingerprint, status=Status.RUNNING, work_dir=str(work), run_id=run.run_id, output=None, entry=entry)
    ctx = _context(cfg, step, run, work, mlflow_run, input_path, input_format, data_dir)
    t0, ok = time.time(), False
    with streaming.step_log(step.label, work) as log_path:
        entry["log"] = str(log_path)
        try:
            out = run_with_retries(step, ctx, cfg.stage_config(step.name))
            with_finite_check(out)
            with_serving_contract_check(out, cfg)
            record_output(c, mlflow_run, step, work, out, entry, missing)
            memory_vs_plan(c, mlflow_run, cfg, step, entry, missing)
            apply_gate(out, step, entry, smoke=cfg.smoke)
            if not cfg.smoke:  # a smoke run's checkpoints are never registered
                register_outputs(c, cfg, step, out, entry, run.run_id, mlflow_run, data_dir, missing)
            entry["status"], ok = Status.COMPLETED, True
        except Exception as e:
            raise _failure(step, entry, e) from (None if isinstance(e, (StageFailed, LaunchError)) else e)
        except BaseException as e:  # the engine's process tree is already down (tasks.launch kills it on the way out)
            if stopped_from_outside(e):
                entry.update(status=Status.CANCELLED, error=describe_stop(e))
            raise
        finally:
            entry["seconds"] = round(time.time() - t0, 2)
            def record():
                index.put(step.fingerprint, status=entry["status"], work_dir=str(work), run_id=run.run_id,
                          output=entry.get("output"), entry=entry)

            record()  # before any tracking call: an outage cannot lose it
            if ok:
                remember(index, cfg, step)
            close_stage_run(c, mlflow_run, monitor, entry, ok, log_path, missing)
            if missing:  # what the tracking server did not get, for the summary (a cancelled run's is read from here)
                record()
            streaming.step_finished(step.label, entry, log_path)
    return entry


def _step_run_name() -> str:
    """A stage subflow is named after its step label (`pretrain`, `convert-megatron-to-hf`)."""
    step = prefect_flow_run.get_parameters().get("step")
    return getattr(step, "label", None) or (step.get("label") if isinstance(step, dict) else None) or "step"


_outcomes: dict[str, dict | BaseException] = {}  # step fingerprint -> what its subflow's body returned or raised


def _execute_in_subflow(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
                        input_format: str | None, data_dir: str | None, use_cache: bool = True) -> dict:
    """execute_step, its outcome kept: when Prefect's bookkeeping around the body fails (the server gone), what the
    step did is still known."""
    try:
        entry = execute_step(step, cfg, run, position, input_path, input_format, data_dir, use_cache)
    except BaseException as e:
        _outcomes[step.fingerprint] = e
        raise
    _outcomes[step.fingerprint] = entry
    return entry


STAGE_FLOWS = {
    name: flow(name=f"stage-{name}", flow_run_name=_step_run_name, validate_parameters=False)(_execute_in_subflow)
    for name in STAGES
}


def run_step(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
             input_format: str | None, data_dir: str | None, use_cache: bool = True) -> dict:
    """The step as its stage's Prefect subflow. With the Prefect server gone the step still runs and counts: a subflow
    whose start or end the server missed gives what its body did (or runs it now, if it never started), and the steps
    after it run as plain calls. What the server missed is listed in the entry (ORCHESTRATION_LOST)."""
    args = (step, cfg, run, position, input_path, input_format, data_dir, use_cache)
    if orchestration.lost():
        return _without_subflow(args, orchestration.STAGE_SUBFLOW)
    _outcomes.pop(step.fingerprint, None)
    try:
        return STAGE_FLOWS[step.name](*args)
    except Exception as e:
        if not orchestration.is_outage(e):
            raise
        outcome = _outcomes.pop(step.fingerprint, None)
        what = orchestration.STAGE_SUBFLOW if outcome is None else orchestration.STAGE_SUBFLOW_END
        orchestration.mark_lost(f"{step.label}: {what}", e)
        if outcome is None:  # Prefect could not start the subflow: the step was not run
            return _without_subflow(args, what)
        if isinstance(outcome, BaseException):
            _note_lost(getattr(outcome, "entry", None), what)
            raise outcome from None
        _note_lost(outcome, what)
        return outcome
    finally:
        _outcomes.pop(step.fingerprint, None)  # an exception's frames are not kept past the step


def _without_subflow(args: tuple, what: str) -> dict:
    try:
        entry = execute_step(*args)
    except StageFailed as e:
        _note_lost(e.entry, what)
        raise
    _note_lost(entry, what)
    return entry


def _note_lost(entry: dict | None, what: str) -> None:
    """What the Prefect server never got of this step, in its summary entry."""
    if entry is None:
        return
    entry[orchestration.ORCHESTRATION_LOST] = [what]
    if what == orchestration.STAGE_SUBFLOW:
        entry["prefect_flow_run_id"] = None  # it ran in the pipeline's flow run: no flow run of its own
