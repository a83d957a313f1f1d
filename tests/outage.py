"""Shared by the tracking and orchestration outage tests (tests/test_reliability_{tracking,orchestration}.py) and the
tracking outage benchmark (benchmarks/outage_bench.py): an MLflow server as `make up` runs it, and waiting for an
engine's line while baton runs."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def wait_for_line(path_glob: str, root: Path, mark: str, proc: subprocess.Popen, timeout: float) -> Path:
    """The first file under root matching path_glob that holds mark, while baton (proc) still runs."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        for log in root.glob(path_glob):
            if mark in log.read_text(errors="replace"):
                return log
        time.sleep(0.5)
    raise AssertionError(f"no {mark!r} in {path_glob} after {timeout}s (baton exited with {proc.poll()})")


def wait_http(url: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"{url} not up after {timeout}s")


def start_mlflow(folder: Path, port: int) -> subprocess.Popen:
    """An MLflow server as `make up` runs it, its store and artifacts in folder (a restart finds them again)."""
    log = open(folder / "mlflow.log", "ab")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port",
                             str(port), "--artifacts-destination", str(folder / "artifacts"), "--workers", "1"],
                            env=dict(os.environ, MLFLOW_BACKEND_STORE_URI=f"sqlite:///{folder / 'mlflow.db'}",
                                     MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_http(f"http://127.0.0.1:{port}/health", 240)
    return proc


def stop_mlflow(proc: subprocess.Popen) -> None:
    if proc.poll() is None:  # a test may have killed it already
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
