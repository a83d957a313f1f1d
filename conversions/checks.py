"""A check and a report: the shape every gate and verification level speaks ({"name", "passed", "detail"};
{"passed", "checks", "seconds"}), apart from the ladder itself so that a format's own gate (conversions/gguf_export.py)
and the ladder that runs it (conversions/verify.py) import it without importing each other."""
from __future__ import annotations

import time


def check(name: str, passed: bool, detail: str = "") -> dict:
    return {"name": name, "passed": bool(passed), "detail": detail}


def report(checks: list[dict], seconds: dict | None = None) -> dict:
    out = {"passed": all(c["passed"] for c in checks) and bool(checks), "checks": checks}
    return {**out, "seconds": seconds} if seconds is not None else out


def timed(seconds: dict, level: str, fn):
    """fn(), its time added to seconds[level] (a gate that runs a level twice reports the sum)."""
    t0 = time.perf_counter()
    try:
        return fn()
    finally:
        seconds[level] = round(seconds.get(level, 0) + time.perf_counter() - t0, 3)
