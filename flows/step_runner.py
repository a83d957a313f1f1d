"""The step runner: each step the chain planner made (a stage or a conversion) runs as a Prefect subflow (STAGE_FLOWS,
one per stage). It runs the stage's task inside an MLflow child run, applies the gate, and registers the checkpoint
(alias `candidate`) only when the gate passed. A failed gate fails the step: nothing is promoted."""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from conversions import manifest as mf, verify
from conversions.manifest import Format
from conversions.refusal import Refused
from flows.config import PipelineConfig
from flows import chain_planner as planning
from flows.chain_planner import Step
from flows.runs import Index, StepLock
from flows import report
from tasks import chat_template, events, orchestration, streaming, tracking
from tasks.launch import LaunchError
from tasks import memory_plan as mp
from tasks.registry import CONVERT_STAGE, STAGES, TRAINING_STAGES
from tasks.events import EngineCause
from tasks.stage import Failure, Reason, StageContext, StageOutput, Status, Why, reasons_text


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


def _cached(index: Index, step: Step) -> dict | None:
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


def _work_dir(index: Index, step: Step, run: RunInfo, position: int) -> Path:
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


def _metric_summary(out: StageOutput, history: dict) -> dict:
    metrics = dict(out.metrics)
    loss = history.get(events.TRAIN_LOSS)
    if loss:
        metrics.setdefault("loss_first", loss[0][1])
        metrics.setdefault("loss_last", loss[-1][1])
    return {k: v for k, v in metrics.items() if v is not None}


def data_digest(data_dir: str | Path | None) -> str:
    """Lineage of the data a checkpoint was trained on: the digest of the data stage's manifest (file sha256s)."""
    m = mf.read(Path(data_dir)) if data_dir else None
    if m is None:
        return ""
    return mf.digest_of({k: m[k] for k in ("files", "extra")})


def _register(c, cfg: PipelineConfig, step: Step, out: Path, run_id: str, mlflow_run: str,
              data_dir: str | None, variant: str | None = None) -> dict | None:
    """A version of the config's registered model (or of `<model>-<format>` for another format than HF), alias
    `candidate`; a side output's alias is its variant (`baton-tiny-gguf-file@q8_0`)."""
    m = mf.read(out)
    if m is None:
        return None
    fmt = m["format"]
    if fmt == Format.DATASET:
        return None
    name = cfg.tracking.registered_model if fmt == Format.HF_SAFETENSORS else f"{cfg.tracking.registered_model}-{fmt}"
    alias = variant or "candidate"
    version = tracking.register_checkpoint(
        c, name, out, mlflow_run,
        tags={"stage": step.label, "format": fmt, "baton.run_id": run_id, "manifest_digest": mf.digest_of(m),
              "data_digest": data_digest(data_dir), **({"variant": variant} if variant else {})},
        alias=alias, upload_weights=cfg.tracking.upload_weights,
        artifact_path=f"checkpoint/{variant}" if variant else "checkpoint")
    return {"name": name, "version": version, "alias": alias}


def _register_if_tracked(c, cfg: PipelineConfig, step: Step, out: Path, run_id: str, mlflow_run: str | None,
                         data_dir: str | None, missing: list, variant: str | None = None) -> dict | None:
    """The checkpoint's registration, or None (listed as missing) while the tracking server is unreachable."""
    if mlflow_run is None:  # the stage ran without its MLflow run (listed already)
        return None
    return tracking.attempt(missing, tracking.REGISTRATION, _register, c, cfg, step, out, run_id,
                            mlflow_run, data_dir, variant)


def _register_outputs(c, cfg: PipelineConfig, step: Step, out: StageOutput, entry: dict, run_id: str,
                      mlflow_run: str | None, data_dir: str | None, missing: list) -> None:
    """Past the gate: the checkpoint, and each side output as its own version."""
    if out.output:
        entry["registered"] = _register_if_tracked(c, cfg, step, Path(out.output), run_id, mlflow_run, data_dir,
                                                   missing)
    for variant, side in entry.get("side_outputs", {}).items():
        side["registered"] = _register_if_tracked(c, cfg, step, Path(side["output"]), run_id, mlflow_run, data_dir,
                                                  missing, variant)


# Only an infrastructure fault (a rank or launcher killed by a signal: preemption, a lost node; or a lost peer) is
# retried, in the same work dir, so the engine resumes from its last complete checkpoint. Everything else fails at once
# with its cause: an OOM kill (the same size fails again), a full disk, a non-finite loss, a timeout (a hang), an exit
# code (a bug, bad input). A cause baton's own code finds in a rank (a non-finite loss, ENOSPC in a save, a MemoryError)
# arrives as the rank's failure event (tasks.events.failure); the marks below are for causes from outside it.
# A rank killed by a signal is only text, in torch 2.x too: torchrun then exits 1, and its error file
# (TORCHELASTIC_ERROR_FILE) is a copy of the failed rank's own, which a killed rank never writes.
KILLED_MARKS = ("return code = -9", "exitcode  : -9", "Signal 9 (SIGKILL)", "SIGKILL", "Connection reset by peer",
                "Connection closed by peer")
FATAL_MARKS = {  # what torch, DeepSpeed, transformers and the OS print
    EngineCause.DISK_FULL: ("No space left on device", "ENOSPC"),
    EngineCause.NON_FINITE_LOSS: ("loss is nan", "loss is inf"),
    EngineCause.OUT_OF_MEMORY: ("MemoryError", "OutOfMemoryError", "CUDA out of memory"),
}


def oom_kills() -> int:
    """OOM kills so far in this process's memory cgroup and every cgroup below it (v1 memory.oom_control or v2
    memory.events); 0 where the kernel does not say."""
    root = _memory_cgroup()
    total = 0
    if root is None:
        return 0
    for dirpath, _dirs, files in os.walk(root):
        for name in ("memory.events", "memory.oom_control"):
            if name in files:
                try:
                    for line in Path(dirpath, name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            total += int(value)
                except (OSError, ValueError):
                    pass
    return total


def _memory_cgroup() -> Path | None:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    v2 = [line for line in lines if line.startswith("0::")]
    return Path("/sys/fs/cgroup") / v2[0][3:].lstrip("/") if v2 else None


def failure_class(e: LaunchError, oom_kills_before: int | None = None) -> EngineCause:
    """INFRASTRUCTURE (retried) or the cause that fails the stage at once: TIMEOUT, OUT_OF_MEMORY (an OOM kill or a
    MemoryError), DISK_FULL, NON_FINITE_LOSS, ERROR."""
    if e.timed_out:
        return EngineCause.TIMEOUT
    if e.failures:  # the first rank that found its cause said so: nothing to guess from text
        return e.failures[0].cause
    text = "\n".join(e.tail)
    for cause, marks in FATAL_MARKS.items():  # first: a rank's real cause beats its peers' "connection closed"
        if any(m in text for m in marks):
            return cause
    if oom_kills_before is not None and oom_kills() > oom_kills_before:
        return EngineCause.OUT_OF_MEMORY
    rc = e.returncode
    if (rc is not None and (rc < 0 or rc >= 128)) or any(m in text for m in KILLED_MARKS):
        return EngineCause.INFRASTRUCTURE
    return EngineCause.ERROR


def cause_line(e: LaunchError, cause: EngineCause) -> str:
    """': <the line that names the cause>': the announcing rank's own (its failure event), else the engine's line
    with the most of the cause's marks (the first of those), so the stage's one-line error says it; '' when none
    does."""
    announced = [f.detail for f in e.failures if f.cause == cause]
    if announced:
        return f": {announced[0].strip()[:600]}"
    marks = FATAL_MARKS.get(cause, ())
    hits = [(sum(m in line for m in marks), -i, line) for i, line in enumerate(e.tail)]
    best = max(hits, default=(0, 0, ""))
    return f": {best[2].strip()[:600]}" if best[0] else ""


def _run_with_retries(step: Step, ctx: StageContext, stage_cfg) -> StageOutput:
    """BATON_INFRA_RETRIES (default 2) retries after BATON_INFRA_RETRY_DELAY_S (default 10) seconds."""
    retries = int(os.environ.get("BATON_INFRA_RETRIES", "2"))
    delay = float(os.environ.get("BATON_INFRA_RETRY_DELAY_S", "10"))
    task = STAGES[step.name].load_task()
    if orchestration.lost():  # a Prefect task run first asks the server for its tags' concurrency slots
        task = getattr(task, "fn", task)
    for attempt in range(retries + 1):
        before = oom_kills()
        try:
            return task(ctx, stage_cfg)
        except LaunchError as e:
            cause = failure_class(e, before)
            if cause != EngineCause.INFRASTRUCTURE:
                raise LaunchError(f"{str(e).splitlines()[0]} ({cause}; not retried){cause_line(e, cause)}",
                                  e.returncode, e.tail, timed_out=e.timed_out, failures=e.failures) from None
            if attempt == retries:
                raise
            get_run_logger().warning("%s: infrastructure failure (%s); retry %d of %d in %.0fs, resuming from the last "
                                     "checkpoint in %s", step.label, str(e).splitlines()[0], attempt + 1, retries,
                                     delay, ctx.work_dir)
            time.sleep(delay)
    raise AssertionError("unreachable")


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
                          {**_new_entry(step), "status": Status.FAILED, "error": problem, "failure": Failure.NO_ROOM})


def _new_entry(step: Step) -> dict:
    entry = {"name": step.name, "label": step.label, "status": Status.RUNNING, "fingerprint": step.fingerprint,
             "implicit": step.implicit, "prefect_flow_run_id": prefect_flow_run.get_id()}
    if step.name == CONVERT_STAGE:
        entry.update(step.extra)
    return entry


def _why_run(index: Index, cfg: PipelineConfig, step: Step, use_cache: bool) -> list[dict]:
    last = index.last(cfg.name, step.label) or {}
    return [r.to_dict() for r in planning.why_run(step, index.get(step.fingerprint), last.get("facts"), use_cache)]


def _remember(index: Index, cfg: PipelineConfig, step: Step) -> None:
    """This step's facts as the last completed ones of its label under this config: what the next run compares with."""
    if step.facts:
        index.put_last(cfg.name, step.label, step.fingerprint, step.facts)


def _reuse(rec: dict, entry: dict) -> dict:
    get_run_logger().info("=== %s: unchanged code, inputs and config; reusing %s ===", entry["label"], rec.get("output"))
    cached = dict(rec["entry"])
    cached.update(status=Status.CACHED, prefect_flow_run_id=entry["prefect_flow_run_id"], cached_from=rec.get("run_id"),
                  reason=[Reason(Why.CACHED).to_dict()])
    streaming.step_finished(entry["label"], cached)
    return cached


def _start_stage_run(c, cfg: PipelineConfig, step: Step, run: RunInfo, entry: dict, missing: list) -> str | None:
    """The stage's MLflow child run, tagged for lineage, with its resolved config as params (None: the tracking server
    is unreachable; the stage runs without)."""
    mlflow_run = tracking.attempt(
        missing, "the stage's MLflow run", tracking.start_run, c, cfg.tracking.experiment, step.label,
        tags={"baton.stage": step.name, "baton.run_id": run.run_id, "baton.fingerprint": step.fingerprint,
              "baton.reason": reasons_text(entry.get("reason"))[:1000],
              tracking.PREFECT_TAG: entry["prefect_flow_run_id"] or "",
              "prefect.pipeline_flow_run_id": run.prefect_flow_run_id or "",
              **report.prefect_link_tags(entry["prefect_flow_run_id"])},
        parent_run_id=run.mlflow_parent)
    if mlflow_run is None:
        return None
    tracking.attempt(missing, "params", tracking.log_params, c, mlflow_run,
                     {"stage": cfg.stage_config(step.name).model_dump(), "model": cfg.model.model_dump(),
                      **({"convert": step.extra} if step.name == CONVERT_STAGE else {})})
    report.link_mlflow_run(mlflow_run, f"{step.label}: MLflow run")
    return mlflow_run


def _context(cfg: PipelineConfig, step: Step, run: RunInfo, work: Path, mlflow_run: str, input_path: str | None,
             input_format: str | None, data_dir: str | None) -> StageContext:
    return StageContext(
        stage=step.name, run_id=run.run_id, run_dir=run.run_dir, work_dir=work,
        model=chat_template.resolved(cfg.model.model_dump()),
        seed=cfg.seed, data_dir=Path(data_dir) if data_dir else None, input=Path(input_path) if input_path else None,
        input_format=input_format, runtimes=cfg.engine_runtimes(),
        mlflow_run_id=mlflow_run, tracking=cfg.tracking.model_dump(), extra=dict(step.extra))


def _summary_metrics(entry: dict, out: StageOutput) -> dict:
    metrics = {k: v for k, v in entry["metrics"].items() if isinstance(v, (int, float))}
    for k in ("before", "after"):
        if out.eval and isinstance(out.eval.get(k), (int, float)):
            metrics[f"eval_{out.eval['metric']}_{k}"] = out.eval[k]
    return metrics


def serving_contracts(output) -> tuple[dict | None, dict | None]:
    """(the parent's serving contract, the output's), from the two manifests; None where one is missing."""
    try:
        m = mf.read(Path(output)) if output else None
        parent = mf.read(Path(m["parent"]["path"])) if m and (m.get("parent") or {}).get("path") else None
    except (mf.ManifestError, OSError):
        return None, None
    return (parent or {}).get("serving"), (m or {}).get("serving")


def serving_changes(output) -> list[str]:
    """What the step's output changed in its parent's serving contract (tokenizer, chat template, special tokens,
    stop tokens, generation defaults), from the two manifests."""
    return mf.serving_changes(*serving_contracts(output))


def _close_sink(mlflow_run: str | None, missing: list, timeout: float | None = None) -> dict:
    """The engine's metrics: the last ones sent (or saved locally, listed as missing); their history."""
    sink = streaming.pop_sink(mlflow_run)
    if sink is None:
        return {}
    sink.close(timeout)
    if sink.unsent:
        missing.append(f"metrics: {sink.unsent} saved to {sink.unsent_path()}")
    return sink.history


def _record_output(c, mlflow_run: str | None, step: Step, work: Path, out: StageOutput, entry: dict,
                   missing: list) -> None:
    """What the stage produced, into its summary entry and its MLflow run: gate, manifest, loss plot, key metrics."""
    from mlflow.entities import Metric

    history = {**_close_sink(mlflow_run, missing), **out.history}
    entry.update(engine=out.engine, backend=out.backend, output=str(out.output) if out.output else None,
                 manifest=str(Path(out.output) / mf.MANIFEST_NAME) if out.output else None,
                 gate=out.gate, metrics=_metric_summary(out, history), eval=out.eval, **out.extra)
    if out.side_outputs:
        entry["side_outputs"] = {variant: {"output": str(path), "manifest": str(Path(path) / mf.MANIFEST_NAME)}
                                 for variant, path in out.side_outputs.items()}
    changed = serving_changes(out.output)
    if changed:  # the gate's contract.serving check decides whether the change was asked for
        entry["serving_contract_changed"] = changed
        get_run_logger().warning("%s changed the serving contract: %s", step.label, "; ".join(changed))
    plot = report.loss_plot(history, work / "loss.png", step.label)
    if plot:
        entry["loss_plot"] = str(plot)
    if mlflow_run is None:
        return
    tracking.attempt(missing, "gate.json", tracking.log_json, c, mlflow_run, out.gate, "gate.json")
    if out.output and (Path(out.output) / mf.MANIFEST_NAME).exists():
        tracking.attempt(missing, mf.MANIFEST_NAME, tracking.log_file, c, mlflow_run, Path(out.output) / mf.MANIFEST_NAME)
    for variant, path in out.side_outputs.items():  # manifests, not weights: the versions point at the files
        tracking.attempt(missing, f"{variant}/{mf.MANIFEST_NAME}", tracking.log_file, c, mlflow_run,
                         Path(path) / mf.MANIFEST_NAME, variant)
    if plot:
        tracking.attempt(missing, plot.name, tracking.log_file, c, mlflow_run, plot)
    now = int(time.time() * 1000)
    tracking.attempt(missing, "summary metrics", c.log_batch, mlflow_run,
                     metrics=[Metric(events.summary_name(k), float(v), now, 0)
                              for k, v in _summary_metrics(entry, out).items()])


def _with_finite_check(out: StageOutput) -> None:
    """Every gate also checks that all weights are finite, whatever the stage's own checks were."""
    if not out.output or not out.gate.get("passed") or not (Path(out.output) / mf.MANIFEST_NAME).exists():
        return
    if any(c["name"] == "weights.finite" for c in out.gate.get("checks", [])):
        return
    try:
        checks = verify.finite_weights(Path(out.output))
    except Exception as e:  # unreadable weights are not verified weights
        checks = [verify.check("weights.finite", False, f"{type(e).__name__}: {e}")]
    out.gate = verify.report(out.gate.get("checks", []) + checks, out.gate.get("seconds"))


# What a config can ask a stage to change in the serving contract: model.chat_template renders a new template, and
# the stage that writes it makes the template's end-of-turn token a stop token (conversions.chat.add_end_of_turn_stop).
END_OF_TURN = "model.chat_template: its end-of-turn token stops a reply"
STOP_FIELDS = ("stop_token_ids", "generation_config.eos_token_id")
ASKED_BY = {"chat_template_sha256": "model.chat_template", **dict.fromkeys(STOP_FIELDS, END_OF_TURN)}


def serving_contract_check(output, cfg: PipelineConfig) -> dict | None:
    """contract.serving: the stage kept its parent's tokenizer, chat template, special tokens, stop tokens and
    generation defaults, or changed only what its config asked for (None: no parent to compare with)."""
    m = None
    try:
        m = mf.read(Path(output)) if output else None
    except mf.ManifestError:
        pass
    if not m or not (m.get("parent") or {}).get("path"):
        return None
    before, after = serving_contracts(output)
    changed = mf.serving_changes(before, after)
    asked = [c for c in changed if _asked_for(c.split(":")[0], cfg, before, after)]
    unasked = [c for c in changed if c not in asked]
    if unasked:
        return verify.check("contract.serving", False, "changed without the config asking: " + "; ".join(unasked))
    if asked:
        return verify.check("contract.serving", True, "changed as the config asks: " + "; ".join(
            f"{c} ({ASKED_BY[c.split(':')[0]]})" for c in asked))
    return verify.check("contract.serving", True, "tokenizer, chat template, special tokens, stop tokens and "
                                                  "generation defaults as in the parent checkpoint")


def _asked_for(field: str, cfg: PipelineConfig, before: dict, after: dict) -> bool:
    if field not in ASKED_BY or cfg.model.chat_template is None:
        return False
    return field not in STOP_FIELDS or _stop_added_with_the_template(before, after)


def _stop_added_with_the_template(before: dict, after: dict) -> bool:
    """The stop tokens only grew, in the stage that gave the checkpoint its (new) chat template."""
    old, new = set(before.get("stop_token_ids") or []), set(after.get("stop_token_ids") or [])
    return old < new and after.get("chat_template_sha256") not in (None, before.get("chat_template_sha256"))


def _with_serving_contract_check(out: StageOutput, cfg: PipelineConfig) -> None:
    """Every gate of a stage that derives a checkpoint also checks its serving contract against the parent's."""
    if not out.output or any(c["name"] == "contract.serving" for c in out.gate.get("checks", [])):
        return
    chk = serving_contract_check(out.output, cfg)
    if chk is not None:
        out.gate = verify.report(out.gate.get("checks", []) + [chk], out.gate.get("seconds"))


def _memory_vs_plan(c, mlflow_run: str | None, cfg: PipelineConfig, step: Step, entry: dict, missing: list) -> None:
    """A training stage's measured per-rank peak beside `baton plan`'s prediction, in the summary and MLflow."""
    from tasks.memory_plan import predicted_peak_mb

    if step.name not in TRAINING_STAGES:
        return
    predicted = predicted_peak_mb(cfg, step.name)
    measured = entry["metrics"].get("peak_mem_mib")
    entry["memory"] = {"predicted_mb_per_rank": round(predicted), "measured_mb_max": measured,
                       "kind": "GPU allocated" if cfg.stage_config(step.name).resolved_device() == "cuda" else "RSS"}
    if mlflow_run is not None:
        tracking.attempt(missing, "predicted memory", c.log_metric, mlflow_run,
                         events.summary_name("predicted_peak_mem_mib"), predicted)


def _apply_gate(out: StageOutput, step: Step, entry: dict, smoke: bool = False) -> None:
    """A failed gate fails the stage; in a smoke run only the quality checks may fail (reported)."""
    from flows.smoke import smoke_gate_passed

    logger = get_run_logger()
    for chk in out.gate.get("checks", []):
        logger.info("gate %s [%s] %s", chk["name"], "ok" if chk["passed"] else "FAIL", chk["detail"])
    if smoke and not out.gate.get("passed") and smoke_gate_passed(out.gate):
        entry["smoke_quality_not_required"] = [c["name"] for c in out.gate["checks"] if not c["passed"]]
        return
    if not out.gate.get("passed"):
        failed = [chk["name"] for chk in out.gate.get("checks", []) if not chk["passed"]]
        entry.update(status=Status.FAILED, error=f"gate failed: {', '.join(failed)}", failure=Failure.GATE)
        raise StageFailed(f"{step.label}: {entry['error']} (checkpoint not promoted)", entry)


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


def _close(c, mlflow_run: str | None, monitor, entry: dict, ok: bool, log_path: Path, missing: list) -> None:
    """The stage's MLflow run ends; what the tracking server did not get is listed in the entry (tracking_missing)."""
    cancelled = entry["status"] == Status.CANCELLED  # one try then: Prefect SIGKILLs it 30 s after its SIGTERM
    _close_sink(mlflow_run, missing, 0.0 if cancelled else None)  # still open when the stage failed or was stopped
    if monitor is not None:
        try:
            tracking.attempt([], "system metrics", monitor.finish)
        except Exception:
            pass
    if mlflow_run is not None:
        _end_stage_run(c, mlflow_run, entry, ok, log_path, missing)
    if missing:
        entry[tracking.MISSING] = missing


def _end_stage_run(c, mlflow_run: str, entry: dict, ok: bool, log_path: Path, missing: list) -> None:
    cancelled = entry["status"] == Status.CANCELLED
    end = f"end of run ({'KILLED' if cancelled else 'FINISHED' if ok else 'FAILED'})"
    if cancelled:  # first: Prefect SIGKILLs a cancelled flow's process 30 s after its SIGTERM
        tracking.attempt(missing, end, tracking.end_run, c, mlflow_run, ok, cancelled=True)
    tracking.attempt(missing, "stage.json", tracking.log_json, c, mlflow_run, entry, "stage.json")
    if log_path.exists():
        tracking.attempt(missing, log_path.name, tracking.log_file, c, mlflow_run, log_path)
    if not cancelled:
        tracking.attempt(missing, end, tracking.end_run, c, mlflow_run, ok)


def _close_dead_attempt(dead_run_id: str | None, step: Step, run: RunInfo) -> None:
    """The step's previous owner died holding its lock (SIGKILL, an OOM kill of the flow's process, a lost host), so
    none of its cancellation code ran: its MLflow runs end KILLED and its summary.json says crashed, so nothing shows
    running forever."""
    import json

    from flows.runs import runs_root, write_summary
    from tasks.paths import check_run_id

    if not dead_run_id or dead_run_id == run.run_id:
        return
    note = f"its process died during step {step.label}; found by run {run.run_id}, which took the step over"
    try:
        run_dir = runs_root() / check_run_id(dead_run_id)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {
            "run_id": dead_run_id, "run_dir": str(run_dir), "status": Status.RUNNING,
            "stages": []}  # died in its first step
        if run_dir.exists() and summary.get("status") == Status.RUNNING:
            summary.update(status=Status.CRASHED, error=note)
            write_summary(run_dir, summary)
        c = tracking.client()
        experiments = [e.experiment_id for e in c.search_experiments()]
        for r in c.search_runs(experiments, filter_string=f"tags.`baton.run_id` = '{dead_run_id}' "
                                                          "and attributes.status = 'RUNNING'"):
            c.set_terminated(r.info.run_id, "KILLED")
        get_run_logger().warning("run %s: %s", dead_run_id, note)
    except Exception as e:  # closing another run's records never fails this one
        get_run_logger().warning("could not close the records of dead run %s: %s", dead_run_id, e)


def execute_step(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
                 input_format: str | None, data_dir: str | None, use_cache: bool = True) -> dict:
    """Run one step (or reuse it) under its fingerprint's lock: a second run of the same step waits for the first
    (BATON_NO_WAIT=1 refuses instead, naming the owner) and then reuses its result."""
    wait = os.environ.get("BATON_NO_WAIT", "") not in ("1", "true")
    with StepLock(step.fingerprint, step.label).acquire(run.run_id, wait=wait) as lock:
        _close_dead_attempt((lock.dead_owner or {}).get("run_id"), step, run)
        return _execute_locked(step, cfg, run, position, input_path, input_format, data_dir, use_cache)


def _execute_locked(step: Step, cfg: PipelineConfig, run: RunInfo, position: int, input_path: str | None,
                    input_format: str | None, data_dir: str | None, use_cache: bool) -> dict:
    """Run one step (or reuse it), gate it, register what passed; a failure raises StageFailed carrying its entry."""
    index = Index()
    entry = _new_entry(step)
    if use_cache and STAGES[step.name].cacheable and (rec := _cached(index, step)) is not None:
        _remember(index, cfg, step)
        return _reuse(rec, entry)
    entry["reason"] = _why_run(index, cfg, step, use_cache)
    get_run_logger().info("=== stage %s (%s): %s ===", step.label, STAGES[step.name].description,
                          reasons_text(entry["reason"]))
    check_free_space(cfg, step, run.run_dir)
    c, missing = tracking.client(), []  # missing: what the tracking server did not get (it was unreachable)
    mlflow_run = entry["mlflow_run_id"] = _start_stage_run(c, cfg, step, run, entry, missing)
    monitor = tracking.system_metrics(mlflow_run) if mlflow_run else None
    work = _work_dir(index, step, run, position)
    index.put(step.fingerprint, status=Status.RUNNING, work_dir=str(work), run_id=run.run_id, output=None, entry=entry)
    ctx = _context(cfg, step, run, work, mlflow_run, input_path, input_format, data_dir)
    t0, ok = time.time(), False
    with streaming.step_log(step.label, work) as log_path:
        entry["log"] = str(log_path)
        try:
            out = _run_with_retries(step, ctx, cfg.stage_config(step.name))
            _with_finite_check(out)
            _with_serving_contract_check(out, cfg)
            _record_output(c, mlflow_run, step, work, out, entry, missing)
            _memory_vs_plan(c, mlflow_run, cfg, step, entry, missing)
            _apply_gate(out, step, entry, smoke=cfg.smoke)
            if not cfg.smoke:  # a smoke run's checkpoints are never registered
                _register_outputs(c, cfg, step, out, entry, run.run_id, mlflow_run, data_dir, missing)
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
                _remember(index, cfg, step)
            _close(c, mlflow_run, monitor, entry, ok, log_path, missing)
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
