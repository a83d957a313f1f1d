"""Run an engine command in its runtime: stream its lines to the logs, parse its events, own its whole process tree.

The child starts in its own process group (session). On timeout, failure, cancellation (SIGTERM/SIGINT to us) or our
own death (PR_SET_PDEATHSIG), the whole group is terminated, then killed after a grace period, so no engine
process outlives the stage.
"""
from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from tasks import events

log = logging.getLogger("baton.launch")
_active: set[subprocess.Popen] = set()
_active_lock = threading.Lock()
_handlers_installed = False
R = TypeVar("R", bound=events.WorkerResult)


# what step.log puts before a relayed line: "04:31:45 INFO    prefect.task_runs: [pretrain] "
_LOG_PREFIX = re.compile(r"^\d\d:\d\d:\d\d \S+\s+\S+: (?:\[[^\]]+\] )?")


def without_library_frames(lines: list[str]) -> list[str]:
    """A traceback's frames inside installed libraries (Prefect's task engine, torch's launcher, …) say nothing about
    the failure, whether printed by baton or relayed from an engine's output."""
    out, skipping = [], False
    for line in lines:
        body = _LOG_PREFIX.sub("", line, count=1)
        if body.startswith('  File "'):
            skipping = "site-packages" in body or "dist-packages" in body
        elif not body.startswith("    "):
            skipping = False
        if not skipping:
            out.append(line)
    return out


class LaunchError(RuntimeError):
    """An engine that failed; `tail` is its last output (raw, for the retry classification); the message shows it
    without library traceback frames."""

    def __init__(self, message: str, returncode: int | None, tail: list[str], timed_out: bool = False,
                 failures: Sequence[events.FailureEvent] = ()):
        self.returncode = returncode
        self.tail = tail
        self.timed_out = timed_out  # killed by its stage's timeout_s (a hang: never retried)
        self.failures = list(failures)  # causes its ranks found themselves and announced (tasks.events.failure)
        shown = without_library_frames(tail)
        super().__init__(message + ("\n--- last log lines ---\n" + "\n".join(shown) if shown else ""))


@dataclass
class LaunchResult:
    returncode: int
    events: list[dict] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def results(self) -> dict:
        """Merged fields of every `result` event the worker printed."""
        out: dict = {}
        for e in self.events:
            if e["kind"] == "result":
                out.update({k: v for k, v in e.items() if k != "kind"})
        return out

    def result(self, model: type[R]) -> R:
        """The worker's one `result` event read back into its model (tasks.events: FinetuneResult, ...)."""
        found = [e for e in self.events if e["kind"] == "result"]
        if len(found) != 1:
            raise RuntimeError(f"the worker printed {len(found)} result events (its contract is one, at the end)")
        return model.model_validate({k: v for k, v in found[0].items() if k != "kind"})

    def metrics(self) -> list[dict]:
        return [e for e in self.events if e["kind"] == "metric"]


def _set_pdeathsig() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def kill_group(pgid: int, grace: float = 10.0, alive: Callable[[int], bool] | None = None) -> None:
    """SIGTERM the process group, wait up to grace seconds, then SIGKILL whatever is left."""
    alive = alive or group_alive
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            if not alive(pgid):
                return
            time.sleep(0.1)


def kill_tree(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """kill_group for a process we started (reaping it, so it does not linger as a zombie)."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    kill_group(pgid, grace, alive=lambda g: proc.poll() is None or group_alive(g))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _install_signal_handlers() -> None:
    """On SIGTERM/SIGINT (Prefect cancellation, Ctrl-C), take the engine trees down before we go."""
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return
    if _prefect_owns_sigterm():
        # Prefect's handler raises TerminationSignal here, and run() kills the tree on the way out. Wrapping it would
        # break Prefect's cancel handshake (it checks its handler is in place): the run would end Crashed.
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            terminate_all()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
    _handlers_installed = True


def _prefect_owns_sigterm() -> bool:
    engine = sys.modules.get("prefect.utilities.engine")
    handler = getattr(engine, "_prefect_sigterm_handler", None)
    return handler is not None and signal.getsignal(signal.SIGTERM) is handler


def terminate_all() -> None:
    with _active_lock:
        procs = list(_active)
    for p in procs:
        kill_tree(p, grace=5.0)


def _start(cmd: Sequence[str], env: dict | None, cwd: Path | None) -> subprocess.Popen:
    """The child in its own session (so its whole tree can be killed), stdout and stderr merged into one pipe."""
    full_env = dict(os.environ)
    full_env.update({k: str(v) for k, v in (env or {}).items()})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(
        [str(c) for c in cmd], env=full_env, cwd=str(cwd) if cwd else None, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
        start_new_session=True, preexec_fn=_set_pdeathsig,
    )
    with _active_lock:
        _active.add(proc)
    return proc


def _watchdog(proc: subprocess.Popen, timeout: float | None, name: str) -> tuple[threading.Timer | None, threading.Event]:
    """A timer that kills the tree once timeout seconds have passed; the event says whether it fired."""
    timed_out = threading.Event()
    if not timeout:
        return None, timed_out

    def fire():
        timed_out.set()
        log.error("%s exceeded its timeout of %ss; terminating its process tree", name, timeout)
        kill_tree(proc)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    return timer, timed_out


def _pump(proc: subprocess.Popen, logf, tail: collections.deque, collected: list[dict],
          on_line: Callable[[str], None] | None, on_event: Callable[[dict], None] | None) -> None:
    """Every line to the log file; events to on_event (never to on_line or the tail: they are data, not log)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.rstrip("\n")
        if logf and not logf.closed:
            _write_log(logf, line)
        event = events.parse(line)
        if event is not None:
            collected.append(event)
            if on_event:
                on_event(event)
            continue
        tail.append(line)
        if on_line:
            on_line(line)


def _write_log(logf, line: str) -> None:
    """A log write that fails (ENOSPC: the log shares the disk the engine's checkpoint just filled) closes the log and
    never stops the pump: the engine's own error and exit code still come through (in the tail and the stage log)."""
    try:
        logf.write(line + "\n")
    except OSError as e:
        log.warning("cannot write to %s (%s); its further lines are only in the stage's log", logf.name, e.strerror)
        _close_log(logf)


def _close_log(logf) -> None:
    try:
        logf.close()  # the file is closed even when flushing what it still buffers fails
    except OSError:
        pass


def _reap(proc: subprocess.Popen) -> None:
    """Take down whatever is left of the child's group, and forget it."""
    if proc.poll() is None:
        kill_tree(proc)
    else:  # the leader exited; take down anything it left in its group
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.stdout is not None:
        proc.stdout.close()
    with _active_lock:
        _active.discard(proc)


def _failures(collected: list[dict]) -> list[events.FailureEvent]:
    """The ranks' failure events, in the order they came; one that does not parse is left to the log's text."""
    found = []
    for e in collected:
        if e["kind"] == "failure":
            try:
                found.append(events.FailureEvent.model_validate({k: v for k, v in e.items() if k != "kind"}))
            except ValueError:
                log.warning("unreadable failure event %s", e)
    return found


def run(
    cmd: Sequence[str],
    *,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
    on_event: Callable[[dict], None] | None = None,
    log_path: Path | None = None,
    tail_lines: int = 60,
    name: str = "engine",
) -> LaunchResult:
    """Run cmd to completion; raise LaunchError (exit code + last lines) unless it exits 0."""
    _install_signal_handlers()
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    collected: list[dict] = []
    t0 = time.time()
    log.info("launch %s: %s", name, " ".join(map(str, cmd)))
    proc = _start(cmd, env, cwd)
    timer, timed_out = _watchdog(proc, timeout, name)
    logf = open(log_path, "a", buffering=1) if log_path else None
    try:
        _pump(proc, logf, tail, collected, on_line, on_event)
        proc.wait()
    except BaseException:
        kill_tree(proc)
        raise
    finally:
        if timer:
            timer.cancel()
        if logf:
            _close_log(logf)
        _reap(proc)
    if timed_out.is_set():
        raise LaunchError(f"{name} timed out after {timeout}s", proc.returncode, list(tail), timed_out=True,
                          failures=_failures(collected))
    if proc.returncode != 0:
        raise LaunchError(f"{name} failed with exit code {proc.returncode}", proc.returncode, list(tail),
                          failures=_failures(collected))
    return LaunchResult(proc.returncode, collected, list(tail), time.time() - t0)
