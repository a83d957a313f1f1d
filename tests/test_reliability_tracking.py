"""Tracking outage (issue 12, item 5), for real: the MLflow server (the one `make up` runs, started the same way)
is frozen with SIGSTOP for 10 s while an engine streams metrics, then SIGCONT. The engine is never held up by the
tracking server and every metric arrives."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tasks import launch, tracking

pytestmark = [pytest.mark.ops, pytest.mark.reliability]

ENGINE = """
import json, time
for step in range(1, {n} + 1):
    print('@@baton ' + json.dumps({{"kind": "metric", "step": step, "train/loss": 1.0 / step}}), flush=True)
    time.sleep({pause})
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} not up after {timeout}s")


@pytest.fixture
def mlflow_server(tmp_path, monkeypatch, baton_home):  # after baton_home, which clears MLFLOW_TRACKING_URI
    port = _free_port()
    log = open(tmp_path / "mlflow.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port",
                             str(port), "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
                            env=dict(os.environ, MLFLOW_BACKEND_STORE_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                     MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 240)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        log.close()


def test_mlflow_frozen_mid_stage_loses_no_metric(mlflow_server, baton_home, record_property, monkeypatch):
    record_property("fault", "MLflow server SIGSTOPped 10 s")
    # a client that gives up on a silent server after 3 s (as behind any proxy): each write fails while frozen
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    c = tracking.client()
    assert tracking.tracking_uri().startswith("http://127.0.0.1:")
    run = tracking.start_run(c, "outage", "stage", tags={})
    sink = tracking.MetricSink(c, run, flush_every=0.5)
    n, pause = 100, 0.15  # 15 s of training, the server frozen for 10 of them (three client timeouts and more)

    def freeze_then_thaw():
        time.sleep(2)
        os.killpg(mlflow_server.pid, signal.SIGSTOP)
        time.sleep(10)
        os.killpg(mlflow_server.pid, signal.SIGCONT)

    import threading
    t = threading.Thread(target=freeze_then_thaw)
    t.start()
    t0 = time.time()
    res = launch.run([sys.executable, "-c", ENGINE.format(n=n, pause=pause)], name="engine", timeout=300,
                     on_event=lambda e: sink.add(e["step"], {"train/loss": e["train/loss"]}) if e["kind"] == "metric" else None)
    engine_s = time.time() - t0
    t.join()
    sink.close(timeout=180)
    assert len(res.metrics()) == n
    assert engine_s < n * pause + 15, f"the engine was held up by the frozen tracking server ({engine_s:.0f}s)"
    assert sink.failures > 0  # the outage was real: writes failed and were retried
    assert not (baton_home / "unsent-metrics").exists()
    history = c.get_metric_history(run, "train/loss")
    assert {m.step for m in history} == set(range(1, n + 1))  # every metric arrived (a retried batch may repeat)


@pytest.mark.fast
def test_a_tracking_error_is_never_read_as_no_champion(baton_home, monkeypatch, record_property):
    """`champion_now` decides what a candidate must beat: (None, None) only when no champion exists; an unreachable
    tracking server is an error (read as "no champion", the no-regression check would be skipped)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.serve.task import champion_now

    record_property("fault", "tracking server unreachable when the champion is read")
    store = f"sqlite:///{baton_home / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert champion_now("no-such-model") == (None, None)
    c = MlflowClient(tracking_uri=store, registry_uri=store)
    c.create_registered_model("has-no-champion")
    assert champion_now("has-no-champion") == (None, None)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(MlflowException):
        champion_now("has-no-champion")
