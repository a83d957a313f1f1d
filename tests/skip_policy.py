"""pytest plugin (registered by conftest): under CI=true a skip must name a reason on the allowlist below, and only where
this machine truly lacks what the reason says; any other skip fails the session, listed at the end.

A skipped test proves nothing, and CI's closing line counts it like a pass would look: so skipping is the exception
the suite has to justify, not a way out of a missing package, runtime or privilege.
"""
from __future__ import annotations

import os
import shutil

_skips: list[tuple[str, str]] = []


def _has_nvidia_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidiactl")


# reason (a prefix of the skip's message) -> whether this machine truly is the case the reason names
ALLOWED = {
    "this machine has a GPU": _has_nvidia_gpu,  # CPU-only behaviour, tested where there is no GPU
    "the trap is on machines without GPUs": _has_nvidia_gpu,
    "needs an NVIDIA GPU": lambda: not _has_nvidia_gpu(),
    "numactl is installed here": lambda: shutil.which("numactl") is not None,
    "cannot mount a tmpfs here": lambda: os.geteuid() != 0,
    "cannot create a memory cgroup here": lambda: os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup"),
}


def reason_of(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def allowed(reason: str) -> bool:
    return any(reason.startswith(prefix) and holds() for prefix, holds in ALLOWED.items())


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, reason_of(report)))


def unlisted() -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in _skips if not allowed(reason)]


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("CI") == "true" and unlisted() and session.exitstatus in (0, 5):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    bad = unlisted()
    if not bad:
        return
    verdict = "fails the session (CI=true)" if os.environ.get("CI") == "true" else "would fail it under CI=true"
    terminalreporter.write_line("")
    terminalreporter.write_line(f"{len(bad)} skip(s) for a reason not on tests/skip_policy.py's allowlist {verdict}:",
                                red=True)
    for node, reason in bad:
        terminalreporter.write_line(f"  {node}: {reason}")
