"""What a step leaves in MLflow, the model registry and its summary entry: the stage's child run (tags, params,
metrics, gate, manifest, log), the checkpoint's registration as `candidate`, and the records of an earlier attempt
whose process died. The tracking server may be unreachable: what it did not get is listed (tracking_missing)."""
from __future__ import annotations

import time
from pathlib import Path

from prefect import get_run_logger

from conversions import manifest as mf
from conversions.manifest import Format
from flows import report
from flows.chain_planner import Step
from flows.config import PipelineConfig
from flows.step_entry import RunInfo
from flows.step_gate import serving_changes
from tasks import events, streaming, tracking
from tasks.registry import CONVERT_STAGE, TRAINING_STAGES
from tasks.stage import StageOutput, Status, reasons_text


def close_dead_attempt(dead_run_id: str | None, step: Step, run: RunInfo) -> None:
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


def start_stage_run(c, cfg: PipelineConfig, step: Step, run: RunInfo, entry: dict, missing: list) -> str | None:
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


def record_output(c, mlflow_run: str | None, step: Step, work: Path, out: StageOutput, entry: dict,
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
    if out.artifacts:
        entry["artifacts"] = [str(p) for p in out.artifacts]
    if mlflow_run is None:
        return
    tracking.attempt(missing, "gate.json", tracking.log_json, c, mlflow_run, out.gate, "gate.json")
    if out.output and (Path(out.output) / mf.MANIFEST_NAME).exists():
        tracking.attempt(missing, mf.MANIFEST_NAME, tracking.log_file, c, mlflow_run, Path(out.output) / mf.MANIFEST_NAME)
    for variant, path in out.side_outputs.items():  # manifests, not weights: the versions point at the files
        tracking.attempt(missing, f"{variant}/{mf.MANIFEST_NAME}", tracking.log_file, c, mlflow_run,
                         Path(path) / mf.MANIFEST_NAME, variant)
    for path in ([plot] if plot else []) + out.artifacts:
        tracking.attempt(missing, path.name, tracking.log_file, c, mlflow_run, path)
    now = int(time.time() * 1000)
    tracking.attempt(missing, "summary metrics", c.log_batch, mlflow_run,
                     metrics=[Metric(events.summary_name(k), float(v), now, 0)
                              for k, v in _summary_metrics(entry, out).items()])


def _close_sink(mlflow_run: str | None, missing: list, timeout: float | None = None) -> dict:
    """The engine's metrics: the last ones sent (or saved locally, listed as missing); their history."""
    sink = streaming.pop_sink(mlflow_run)
    if sink is None:
        return {}
    sink.close(timeout)
    if sink.unsent:
        missing.append(f"metrics: {sink.unsent} saved to {sink.unsent_path()}")
    return sink.history


def _metric_summary(out: StageOutput, history: dict) -> dict:
    metrics = dict(out.metrics)
    loss = history.get(events.TRAIN_LOSS)
    if loss:
        metrics.setdefault("loss_first", loss[0][1])
        metrics.setdefault("loss_last", loss[-1][1])
    return {k: v for k, v in metrics.items() if v is not None}


def _summary_metrics(entry: dict, out: StageOutput) -> dict:
    metrics = {k: v for k, v in entry["metrics"].items() if isinstance(v, (int, float))}
    for k in ("before", "after"):
        if out.eval and isinstance(out.eval.get(k), (int, float)):
            metrics[f"eval_{out.eval['metric']}_{k}"] = out.eval[k]
    return metrics


def memory_vs_plan(c, mlflow_run: str | None, cfg: PipelineConfig, step: Step, entry: dict, missing: list) -> None:
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


def register_outputs(c, cfg: PipelineConfig, step: Step, out: StageOutput, entry: dict, run_id: str,
                     mlflow_run: str | None, data_dir: str | None, missing: list) -> None:
    """Past the gate: the checkpoint, and each side output as its own version."""
    if out.output:
        entry["registered"] = _register_if_tracked(c, cfg, step, Path(out.output), run_id, mlflow_run, data_dir,
                                                   missing)
    for variant, side in entry.get("side_outputs", {}).items():
        side["registered"] = _register_if_tracked(c, cfg, step, Path(side["output"]), run_id, mlflow_run, data_dir,
                                                  missing, variant)


def _register_if_tracked(c, cfg: PipelineConfig, step: Step, out: Path, run_id: str, mlflow_run: str | None,
                         data_dir: str | None, missing: list, variant: str | None = None) -> dict | None:
    """The checkpoint's registration, or None (listed as missing) while the tracking server is unreachable."""
    if mlflow_run is None:  # the stage ran without its MLflow run (listed already)
        return None
    return tracking.attempt(missing, tracking.REGISTRATION, _register, c, cfg, step, out, run_id,
                            mlflow_run, data_dir, variant)


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
    name = tracking.registered_name(cfg.tracking.registered_model, fmt)
    alias = variant or "candidate"
    version = tracking.register_checkpoint(
        c, name, out, mlflow_run,
        tags={"stage": step.label, "format": fmt, "baton.run_id": run_id, "manifest_digest": mf.digest_of(m),
              "data_digest": data_digest(data_dir), **({"variant": variant} if variant else {})},
        alias=alias, upload_weights=cfg.tracking.upload_weights,
        artifact_path=f"checkpoint/{variant}" if variant else "checkpoint")
    return {"name": name, "version": version, "alias": alias}


def data_digest(data_dir: str | Path | None) -> str:
    """Lineage of the data a checkpoint was trained on: the digest of the data stage's manifest (file sha256s)."""
    m = mf.read(Path(data_dir)) if data_dir else None
    if m is None:
        return ""
    return mf.digest_of({k: m[k] for k in ("files", "extra")})


def close_stage_run(c, mlflow_run: str | None, monitor, entry: dict, ok: bool, log_path: Path, missing: list) -> None:
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
