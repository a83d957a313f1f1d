"""MLflow tracking: one parent run per pipeline run, one child run per stage, checkpoints in the model registry.

All calls go through MlflowClient with explicit run ids, so stage subflows, threads and worker callbacks never depend
on MLflow's global "active run". Weights are not uploaded unless asked: manifests, reports and plots are.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from conversions.home import home_path

PREFECT_TAG = "prefect.flow_run_id"


def baton_home() -> Path:
    """BATON_HOME, created private (0700) on first use: it holds API keys, the registry and every run's logs."""
    home = home_path().resolve()
    if not home.exists():
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return home


SQLITE_WAIT_S = 300  # several runs share one SQLite file: a writer waits out another's transaction, not 5 s


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{baton_home() / 'mlflow.db'}?timeout={SQLITE_WAIT_S}"


_warm_up: threading.Thread | None = None


def warm_up() -> None:
    """Import MLflow and create (or migrate) the local SQLite tracking store in a thread, so that it overlaps the
    start of Prefect's temporary server (a subprocess; ~30 s on 2 cores for a new home). client() waits for it; a
    failure here is left for client()'s own call to report."""
    global _warm_up
    if _warm_up is None and tracking_uri().startswith("sqlite:///"):
        _warm_up = threading.Thread(target=_warm_up_store, name="mlflow-warm-up", daemon=True)
        _warm_up.start()


def _warm_up_store() -> None:
    try:
        _client().search_experiments(max_results=1)
    except Exception:  # noqa: BLE001 - reported by the first real call
        pass


def client():
    if _warm_up is not None and _warm_up is not threading.current_thread():
        _warm_up.join()
    return _client()


# MLflow's own defaults retry one HTTP call for minutes (7 retries, backoff up to 120 s, 120 s timeouts): with the
# server gone, every bookkeeping call would hold a run that long. These bound a call to seconds; the environment wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def _client():
    import mlflow
    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
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

    from tasks.secrets import redact

    items = [Param(k[:250], v[:6000]) for k, v in flatten(redact(params)).items()]
    for i in range(0, len(items), 100):
        c.log_batch(run_id, params=items[i:i + 100])


def start_run(c, experiment: str, name: str, tags: dict, parent_run_id: str | None = None) -> str:
    tags = dict(tags)
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    tags.setdefault("mlflow.source.name", "baton")
    run = c.create_run(experiment_id(c, experiment), run_name=name, tags={k: str(v) for k, v in tags.items()})
    return run.info.run_id


def end_run(c, run_id: str, ok: bool, cancelled: bool = False) -> None:
    """FINISHED, FAILED, or KILLED for a run stopped from outside (Prefect's cancellation, a SIGTERM, Ctrl-C)."""
    c.set_terminated(run_id, "KILLED" if cancelled else "FINISHED" if ok else "FAILED")


def log_json(c, run_id: str, obj: Any, artifact_file: str) -> None:
    from tasks.secrets import redact

    c.log_dict(run_id, redact(obj), artifact_file)


def log_file(c, run_id: str, path: Path, artifact_path: str | None = None) -> None:
    c.log_artifact(run_id, str(path), artifact_path)


# ---- outages: tracking never holds up a run -------------------------------------------------------------------------
MISSING = "tracking_missing"  # summary.json (the run and each step): what the tracking server never got
REGISTRATION = "registration (alias candidate)"  # the one missing record `baton resend` cannot send afterwards
CALL_LIMIT_S = 20.0  # the longest one bookkeeping call may hold a run (BATON_TRACKING_CALL_S)
DOWN_FOR_S = 30.0  # after a failed call the server counts as down this long: further calls are not tried
STUCK_AFTER_S = 10.0  # a metric send unanswered this long is a frozen server's: the stage's end does not wait on it
_down_until: dict[str, float] = {}  # tracking URI -> until when it counts as down


def remote() -> bool:
    """A tracking server (http/https), which can go away; a local SQLite store cannot."""
    return tracking_uri().startswith(("http://", "https://"))


def unreachable() -> bool:
    return time.time() < _down_until.get(tracking_uri(), 0.0)


def mark_unreachable() -> None:
    _down_until[tracking_uri()] = time.time() + DOWN_FOR_S


def reachable() -> None:
    """A call went through (the metric sender probes while a stage trains): the server is back."""
    _down_until.pop(tracking_uri(), None)


def attempt(missing: list[str], what: str, call, *args, **kwargs):
    """One bookkeeping call a run can go on without (a run's start or end, params, an artifact, a registration).
    Against a tracking server it holds the run at most BATON_TRACKING_CALL_S (default 20 s): when it fails, times out,
    or the server failed within DOWN_FOR_S, `what` is added to missing and None returned. Against the local
    SQLite store the call is made as it is (its errors are baton's, not an outage)."""
    if not remote():
        return call(*args, **kwargs)
    if unreachable():
        missing.append(what)
        return None
    limit = float(os.environ.get("BATON_TRACKING_CALL_S", CALL_LIMIT_S))
    value, error = _time_boxed(call, args, kwargs, limit)
    if error is None:
        return value
    mark_unreachable()
    missing.append(what)
    reason = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
    logging.getLogger("baton.tracking").warning("tracking server %s: %s not recorded (%s)", tracking_uri(), what, reason)
    return None


def _time_boxed(call, args, kwargs, limit: float) -> tuple[Any, BaseException | None]:
    """(value, None) or (None, the error); a call still waiting after limit seconds is left to finish in the
    background (a daemon thread), the run goes on."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = call(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name="tracking-call", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        return None, TimeoutError(f"no answer in {limit:.0f}s")
    return box.get("value"), box.get("error")


class MetricSink:
    """Buffers engine metrics and writes them in batches from a background thread, so a slow or stopped tracking
    server never blocks the engine's log reader (and through its stdout pipe, training). A failed write is retried
    with backoff and nothing is dropped; what is still unsent when the stage ends (after BATON_TRACKING_FLUSH_S,
    default 30 s, of retries) goes to BATON_HOME/unsent-metrics/<run>.jsonl (`unsent` says how many)."""

    MAX_BUFFERED = 200_000  # metrics held in memory while the server is unreachable (~40 MB)

    def __init__(self, c, run_id: str, prefix: str = "", flush_every: float = 2.0):
        self.c, self.run_id, self.prefix, self.flush_every = c, run_id, prefix, flush_every
        self.buf: list = []
        self.lock = threading.Lock()
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.sent = 0
        self.failures = 0
        self.unsent = 0
        self._send_lock = threading.Lock()  # one sender at a time: a batch is never sent twice
        self._sending_since: float | None = None  # when the send in flight began (None: none in flight)
        self._save_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"metrics-{run_id[:8]}", daemon=True)
        self._thread.start()

    def add(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        with self.lock:
            for k, v in values.items():
                if v is None:
                    continue
                self.buf.append(Metric(self.prefix + k, float(v), ts, int(step)))
                self.history.setdefault(k, []).append((int(step), float(v)))

    def _send_some(self) -> bool:
        """Send what is buffered; False when the server failed, or when another send hangs past STUCK_AFTER_S (a
        frozen server holds its request for the client's whole timeout: the stage's end must not wait on it)."""
        while not self._send_lock.acquire(timeout=0.5):
            if self._stuck():
                mark_unreachable()
                return False
        try:
            return self._send_buffered()
        finally:
            self._send_lock.release()

    def _stuck(self) -> bool:
        since = self._sending_since
        return since is not None and time.time() - since > STUCK_AFTER_S

    def _send_buffered(self) -> bool:
        """Send what is buffered, oldest first; False when the server refused or failed (kept for the next try)."""
        while True:
            with self.lock:
                batch = self.buf[:900]
            if not batch:
                return True
            self._sending_since = time.time()
            try:
                self.c.log_batch(self.run_id, metrics=batch)
            except Exception as e:  # an outage: keep the batch, try again later
                self.failures += 1
                mark_unreachable()
                logging.getLogger("baton.tracking").warning("metrics for run %s not sent yet (%s); retrying",
                                                            self.run_id, str(e).splitlines()[0][:200])
                return False
            finally:
                self._sending_since = None
            reachable()
            with self.lock:
                del self.buf[:len(batch)]
                self.sent += len(batch)

    def _loop(self) -> None:
        backoff = self.flush_every
        while not self._stop.is_set():
            self._wake.wait(backoff)
            self._wake.clear()
            if self._send_some():
                backoff = self.flush_every
                continue
            backoff = min(backoff * 2, 30.0)
            self._spill_if_full()

    def _spill_if_full(self) -> None:
        """A long outage: past MAX_BUFFERED metrics the buffer goes to the unsent file, so memory stays bounded."""
        with self.lock:
            if len(self.buf) < self.MAX_BUFFERED:
                return
            rest, self.buf = self.buf, []
        self._save_unsent(rest)

    def flush(self, timeout: float = 0.0) -> bool:
        """Send everything buffered now, retrying until timeout (0: one try, none while the server counts as down);
        True when nothing is left unsent."""
        if timeout <= 0 and unreachable():
            with self.lock:
                return not self.buf
        deadline, delay = time.time() + timeout, 1.0
        while True:
            if self._send_some():
                return True
            if time.time() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 30.0)

    def close(self, timeout: float | None = None) -> None:
        """Stop the background sender after a last flush, retried for timeout (BATON_TRACKING_FLUSH_S, default 30 s;
        one try when the server failed within DOWN_FOR_S); what is still unsent then is saved locally, never dropped
        (the stage's end)."""
        self._stop.set()
        self._wake.set()
        if timeout is None:
            timeout = 0.0 if unreachable() else float(os.environ.get("BATON_TRACKING_FLUSH_S", "30"))
        self.flush(timeout)
        with self.lock:
            rest, self.buf = self.buf, []
        if rest:
            self._save_unsent(rest)

    def unsent_path(self) -> Path:
        return unsent_path(self.run_id)

    def _save_unsent(self, metrics: list) -> None:
        from conversions import durable

        path = self.unsent_path()
        lines = "".join(json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n"
                        for m in metrics)
        with self._save_lock:  # the sender's spill and the stage's end
            before = path.read_text() if path.exists() else ""  # saved before: a spill, an earlier attempt's end
            durable.write_text(path, before + lines)
            self.unsent += len(metrics)
        logging.getLogger("baton.tracking").error("tracking server unreachable: %d metrics of run %s saved to %s",
                                                  len(metrics), self.run_id, path)


def unsent_path(run_id: str) -> Path:
    """Where an MLflow run's metrics wait while its server is unreachable (one JSON line each)."""
    return baton_home() / "unsent-metrics" / f"{run_id}.jsonl"


def resend_unsent(c, run_id: str) -> int:
    """Send an MLflow run's saved metrics, then remove their file; how many were sent."""
    from mlflow.entities import Metric

    path = unsent_path(run_id)
    if not path.exists():
        return 0
    metrics = [Metric(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    for i in range(0, len(metrics), 900):
        c.log_batch(run_id, metrics=metrics[i:i + 900])
    path.unlink()
    return len(metrics)


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


def registered_name(base: str, fmt: str) -> str:
    """The registered model a checkpoint of this format is a version of: `base` for HF, `<base>-<format>` else."""
    from conversions.manifest import Format

    return base if fmt == Format.HF_SAFETENSORS else f"{base}-{fmt}"


def register_checkpoint(c, model_name: str, path: Path, run_id: str, tags: dict, alias: str | None = "candidate",
                        upload_weights: bool = False, artifact_path: str = "checkpoint") -> str:
    """A model version whose source is the checkpoint folder (weights stay where they are unless upload_weights);
    `artifact_path`: where in the run's artifacts (a stage that registers several folders gives each its own)."""
    from mlflow.exceptions import MlflowException

    try:
        c.create_registered_model(model_name)
    except MlflowException:
        pass
    source = str(Path(path).resolve())
    tags = {**tags, "checkpoint_path": source}
    if upload_weights:
        c.log_artifacts(run_id, source, artifact_path)
        source = f"{c.get_run(run_id).info.artifact_uri}/{artifact_path}"
    elif not tracking_uri().startswith("sqlite:"):  # a tracking server refuses sources outside the run's artifacts
        c.log_artifact(run_id, str(Path(path) / "baton_manifest.json"), artifact_path)
        source = f"{c.get_run(run_id).info.artifact_uri}/{artifact_path}"
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


def alias_target(c, name: str, alias: str):
    """The model version an alias points at, or None when the registered model or the alias does not exist. Any other
    tracking error (a server down, refused credentials) is raised: read as "no champion" it would skip the
    no-regression check."""
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version_by_alias(name, alias)
    except MlflowException as e:
        if e.error_code == "RESOURCE_DOES_NOT_EXIST":  # no such registered model (yet)
            return None
        if alias not in c.get_registered_model(name).aliases:  # the store says "not found" as a bad parameter
            return None
        raise


def _alias_version(c, name: str, alias: str) -> str | None:
    mv = alias_target(c, name, alias)
    return None if mv is None else str(mv.version)


ANY = object()  # `expected` default: move the alias whatever it points at now


class AliasMoved(RuntimeError):
    """The alias changed between a decision and its move: nothing was changed."""


def alias_lock(name: str):
    """Serializes every alias move of one registered model across processes on this BATON_HOME (MLflow itself has
    no compare-and-set): read, compare, write happen under it."""
    import filelock

    folder = baton_home() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return filelock.FileLock(str(folder / f"alias-{safe}.lock"), timeout=300)


def _check_unmoved(name: str, current: str | None, expected) -> None:
    if expected is not ANY and current != (str(expected) if expected is not None else None):
        raise AliasMoved(f"{name}@{CHAMPION} moved since this decision was made (expected version {expected}, now "
                         f"{current}); nothing changed: decide again against the new champion")


def promote_champion(c, name: str, version: str, tags: dict | None = None, expected=ANY) -> dict:
    """Move `champion` to version (compare-and-set: only if it still points at `expected`, None for no champion);
    the version it replaces stays registered, recorded in a tag and `previous-champion`."""
    version = str(version)
    with alias_lock(name):
        previous = _alias_version(c, name, CHAMPION)
        _check_unmoved(name, previous, expected)
        for k, v in (tags or {}).items():
            c.set_model_version_tag(name, version, k, str(v))
        if previous == version:
            return {"name": name, "version": version, "changed": False,
                    "previous": c.get_model_version(name, version).tags.get(REPLACED_TAG) or None}
        c.set_model_version_tag(name, version, REPLACED_TAG, previous or "")
        c.set_registered_model_alias(name, CHAMPION, version)
        if previous:
            c.set_registered_model_alias(name, PREVIOUS, previous)
    return {"name": name, "version": version, "previous": previous, "changed": True}


def rollback_champion(c, name: str, expected=ANY) -> dict:
    """Move `champion` back to the version the current champion replaced (repeatable down the chain); with
    `expected`, only if the champion is still that version."""
    with alias_lock(name):
        current = _alias_version(c, name, CHAMPION)
        if current is None:
            raise ValueError(f"registered model {name!r} has no {CHAMPION!r} alias: nothing to roll back")
        _check_unmoved(name, current, expected)
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
