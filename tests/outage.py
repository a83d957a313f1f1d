"""Shared by the tracking and orchestration outage tests (tests/test_reliability_{tracking,orchestration}.py)."""
from __future__ import annotations

import subprocess
import time
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
