"""pytest plugin (registered by conftest): under CI (CI set to true, 1, yes or on, in any case) a skip must name a
reason on the allowlist below, and only where this machine truly lacks what the reason says; any other skip fails the
session, listed at the end. That holds for a skip at run time, a skip at collection time (a module-level
`pytest.skip` or `importorskip`) and an `xfail` (an expected failure proves nothing either). With
BATON_FAIL_IF_ALL_SKIPPED=1 (`make test-multinode`) a session whose every selected test was skipped fails, CI or not:
the multi-node tests skipped wholesale where nothing can be isolated would otherwise pass.

A skipped test proves nothing, and CI's closing line counts it like a pass would look: so skipping is the exception
the suite has to justify, not a way out of a missing package, runtime or privilege.
"""
from __future__ import annotations

import os
import shutil

_skips: list[tuple[str, str]] = []
_ran: list[str] = []  # tests that ran (passed or failed) rather than skipped
TRUTHY = {"1", "true", "yes", "on"}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in TRUTHY


def all_must_not_skip() -> bool:
    return os.environ.get("BATON_FAIL_IF_ALL_SKIPPED", "").strip().lower() in TRUTHY


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
    if hasattr(report, "wasxfail"):
        if report.when == "call" or report.skipped:
            _skips.append((report.nodeid, f"xfail: {report.wasxfail or 'no reason given'}"))
    elif report.skipped:
        _skips.append((report.nodeid, reason_of(report)))
    elif report.when == "call":
        _ran.append(report.nodeid)


def pytest_collectreport(report):
    if report.skipped:  # the whole module (or class) skipped while it was collected
        _skips.append((report.nodeid, reason_of(report)))


def unlisted() -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in _skips if not allowed(reason)]


def everything_skipped() -> bool:
    return bool(_skips) and not _ran


def pytest_sessionfinish(session, exitstatus):
    if session.exitstatus not in (0, 5):
        return
    if (in_ci() and unlisted()) or (all_must_not_skip() and (everything_skipped() or not _ran)):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if all_must_not_skip() and not _ran:
        terminalreporter.write_line(f"every selected test was skipped ({len(_skips)}), or none was selected: this "
                                    "session proves nothing and fails (BATON_FAIL_IF_ALL_SKIPPED)", red=True)
    bad = unlisted()
    if not bad:
        return
    verdict = "fails the session (CI)" if in_ci() else "would fail it under CI"
    terminalreporter.write_line("")
    terminalreporter.write_line(f"{len(bad)} skip(s) or xfail(s) for a reason not on tests/skip_policy.py's allowlist "
                                f"{verdict}:", red=True)
    for node, reason in bad:
        terminalreporter.write_line(f"  {node}: {reason}")
