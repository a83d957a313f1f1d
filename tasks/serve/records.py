"""What a recorded process is: its pid and start time, so a pid reused since is never signalled; and the JSON records
(serving.json, a supervisor's state file) read leniently (absent or torn reads as None)."""
from __future__ import annotations

import json
from pathlib import Path


def started_at(pid: int | None) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time() if pid else None
    except psutil.Error:
        return None


def same_process(pid: int | None, started: float | None) -> bool:
    """pid is still the process recorded (same start time): a pid reused since is never signalled."""
    created = started_at(pid)
    return created is not None and (started is None or abs(created - float(started)) < 1.0)


def read_json(path: Path | str | None) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, TypeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def running(pid: int, started: float | None) -> bool:
    """Recorded process still running (a zombie, exited but not yet reaped by its parent, is not)."""
    import psutil

    try:
        return same_process(pid, started) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
