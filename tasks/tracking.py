"""MLflow tracking: one parent run per pipeline run, one child run per stage, checkpoints in the model registry.

All calls go through MlflowClient with explicit run ids, so stage subflows, threads and worker callbacks never depend
on MLflow's global "active run". Weights are not uploaded unless asked: manifests, reports and plots are.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PREFECT_TAG = "prefect.flow_run_id"


def baton_home() -> Path:
    return Path(os.environ.get("BATON_HOME", ".baton")).resolve()


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{baton_home() / 'mlflow.db'}"


def client():
    import mlflow
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        baton_home().mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


EXPERIMENT_KIND = "mlflow.experimentKind"  # read by the MLflow 3 UI


def experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND not in exp.tags:  # made before baton set it
            c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, "custom_model_development")
        return exp.experiment_id
    artifacts = None
    if tracking_uri().startswith("sqlite:///"):  # keep artifacts under BATON_HOME, not the current directory
        artifacts = (baton_home() / "mlartifacts").as_uri()
    try:
        # the UI then opens it in the model-training layout (runs, metrics charts), not the GenAI evaluation one
        return c.create_experiment(name, artifact_location=artifacts, tags={EXPERIMENT_KIND: "custom_model_development"})
    except Exception:  # created concurrently
        return c.get_experiment_by_name(name).experiment_id


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


def log_params(c, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(k[:250], v[:6000]) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


def start_run(c, experiment: str, name: str, tags: dict, parent_run_id: str | None = None) -> str:
    tags = dict(tags)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    tags.setdefault("mlflow.source.name", "baton")
    run = c.create_run(experiment_id(c, experiment), run_name=name, tags={k: str(v) for k, v in tags.items()})
    return run.info.run_id


def end_run(c, run_id: str, ok: bool) -> None:
    c.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def log_json(c, run_id: str, obj: Any, artifact_file: str) -> None:
    c.log_dict(run_id, obj, artifact_file)


def log_file(c, run_id: str, path: Path, artifact_path: str | None = None) -> None:
    c.log_artifact(run_id, str(path), artifact_path)


class MetricSink:
    """Buffers engine metrics and writes them in batches (one SQLite transaction per flush, not per value)."""

    def __init__(self, c, run_id: str, prefix: str = "", flush_every: float = 2.0):
        self.c, self.run_id, self.prefix, self.flush_every = c, run_id, prefix, flush_every
        self.buf: list = []
        self.last = time.time()
        self.lock = threading.Lock()
        self.history: dict[str, list[tuple[int, float]]] = {}

    def add(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self.lock:
            for k, v in values.items():
                if v is None:
                    continue
                self.buf.append(Metric(self.prefix + k, float(v), ts, int(step)))
                self.history.setdefault(k, []).append((int(step), float(v)))
        if time.time() - self.last > self.flush_every:
            self.flush()

    def flush(self) -> None:
        with self.lock:
            buf, self.buf = self.buf, []
            self.last = time.time()
        for i in range(0, len(buf), 900):
            self.c.log_batch(self.run_id, metrics=buf[i:i + 900])


def log_dataset(c, run_id: str, path: Path, name: str, context: str, digest: str) -> None:
    """Record a jsonl file as an MLflow dataset input (name, digest, source, schema)."""
    import mlflow.data
    import pandas as pd
    from mlflow.entities import DatasetInput, InputTag

    df = pd.read_json(path, lines=True)
    ds = mlflow.data.from_pandas(df, source=str(path), name=name, digest=digest[:36])
    entity = ds._to_mlflow_entity()
    c.log_inputs(run_id, datasets=[DatasetInput(entity, tags=[InputTag("mlflow.data.context", context)])])


def system_metrics(run_id: str):
    """Start MLflow's system-metrics sampler for a run (CPU, memory, disk); returns an object with .finish()."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        mon = SystemMetricsMonitor(run_id, sampling_interval=5, samples_before_logging=1)
        mon.start()
        return mon
    except Exception:  # psutil missing or unsupported platform: tracking goes on without it
        return None


def register_checkpoint(c, model_name: str, path: Path, run_id: str, tags: dict, alias: str | None = "candidate",
                        upload_weights: bool = False) -> str:
    """A model version whose source is the checkpoint folder (weights stay where they are unless upload_weights)."""
    from mlflow.exceptions import MlflowException

    try:
        c.create_registered_model(model_name)
    except MlflowException:
        pass
    source = str(Path(path).resolve())
    tags = {**tags, "checkpoint_path": source}
    if upload_weights:
        c.log_artifacts(run_id, source, "checkpoint")
        source = f"{c.get_run(run_id).info.artifact_uri}/checkpoint"
    elif not tracking_uri().startswith("sqlite:"):  # a tracking server refuses sources outside the run's artifacts
        c.log_artifact(run_id, str(Path(path) / "baton_manifest.json"), "checkpoint")
        source = f"{c.get_run(run_id).info.artifact_uri}/checkpoint"
    mv = c.create_model_version(model_name, source=source, run_id=run_id,
                                tags={k: str(v) for k, v in tags.items()})
    if alias:
        c.set_registered_model_alias(model_name, alias, mv.version)
    return mv.version


def resolve_model_ref(ref: str) -> tuple[Path, str, str]:
    """`name@alias` or `name/version` → (checkpoint folder, name, version)."""
    c = client()
    if "@" in ref:
        name, alias = ref.split("@", 1)
        mv = c.get_model_version_by_alias(name, alias)
    else:
        name, version = ref.rsplit("/", 1)
        mv = c.get_model_version(name, version)
    local = mv.tags.get("checkpoint_path")
    if local and Path(local).exists():  # registered in place: the source holds only the manifest
        return Path(local), name, mv.version
    src = mv.source
    if src.startswith("file://"):
        src = src[len("file://"):]
    if "://" in src or src.startswith(("runs:", "models:", "mlflow-artifacts:")):
        import mlflow.artifacts

        src = mlflow.artifacts.download_artifacts(artifact_uri=src, dst_path=tempfile.mkdtemp(prefix="baton-model-"))
    return Path(src), name, mv.version


# ---- serving aliases (champion / rollback) --------------------------------------------------------------------------
CHAMPION, PREVIOUS = "champion", "previous-champion"
REPLACED_TAG = "baton.replaced_champion"  # on a version: the champion version it replaced ("" when none)


def _alias_version(c, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def promote_champion(c, name: str, version: str, tags: dict | None = None) -> dict:
    """Move `champion` to version; the version it replaces stays registered, recorded in a tag and `previous-champion`."""
    version = str(version)
    previous = _alias_version(c, name, CHAMPION)
    for k, v in (tags or {}).items():
        c.set_model_version_tag(name, version, k, str(v))
    if previous == version:
        return {"name": name, "version": version, "previous": c.get_model_version(name, version).tags.get(REPLACED_TAG)
                or None, "changed": False}
    c.set_model_version_tag(name, version, REPLACED_TAG, previous or "")
    c.set_registered_model_alias(name, CHAMPION, version)
    if previous:
        c.set_registered_model_alias(name, PREVIOUS, previous)
    return {"name": name, "version": version, "previous": previous, "changed": True}


def rollback_champion(c, name: str) -> dict:
    """Move `champion` back to the version the current champion replaced (repeatable down the chain)."""
    current = _alias_version(c, name, CHAMPION)
    if current is None:
        raise ValueError(f"registered model {name!r} has no {CHAMPION!r} alias: nothing to roll back")
    previous = c.get_model_version(name, current).tags.get(REPLACED_TAG) or None
    if not previous:
        raise ValueError(f"{name} version {current} is the first champion: there is no earlier one to roll back to")
    c.set_model_version_tag(name, current, "baton.rolled_back", "true")
    c.set_registered_model_alias(name, CHAMPION, previous)
    before = c.get_model_version(name, previous).tags.get(REPLACED_TAG) or None
    if before:
        c.set_registered_model_alias(name, PREVIOUS, before)
    else:
        try:
            c.delete_registered_model_alias(name, PREVIOUS)
        except Exception:
            pass
    return {"name": name, "from": current, "to": previous}


def find_version_by_digest(c, name: str, manifest_digest: str):
    """The registered version of a checkpoint, found by its manifest digest tag (None when not registered)."""
    from mlflow.exceptions import MlflowException

    try:
        found = c.search_model_versions(f"name = '{name}' and tags.manifest_digest = '{manifest_digest}'")
    except MlflowException:
        return None
    return max(found, key=lambda mv: int(mv.version)) if found else None
