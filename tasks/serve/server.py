"""A long-running engine server: start it in its own process group, stream its (redacted) log, wait for /health,
and stop the whole group. Unlike `tasks.launch.run`, the caller keeps working while the server runs."""
from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from tasks import events, launch
from tasks.health import Unhealthy, wait_http_ok
from tasks.serve.records import read_json, same_process
from tasks.distributed.net import free_port  # noqa: F401 (the repo's one free-port helper)

log = logging.getLogger("baton.serve")


class ServerFailed(RuntimeError):
    def __init__(self, message: str, tail: list[str]):
        self.tail = tail
        super().__init__(message + ("\n--- last log lines ---\n" + "\n".join(tail) if tail else ""))


def redactor(*secrets: str) -> Callable[[str], str]:
    """Engines print their arguments (SGLang logs server_args with api_key): hide the secrets in every line."""
    secrets = tuple(s for s in secrets if s)

    def redact(line: str) -> str:
        for s in secrets:
            line = line.replace(s, "***")
        return line

    redact.secrets = secrets  # for the supervisor of a detached server
    return redact


SHM = Path("/dev/shm")
# What engines leave in /dev/shm when they exit without cleaning up: SGLang's weight-loading segments and the POSIX
# semaphores of Python's multiprocessing; DeepSpeed's shm comm op (one per rank).
LEFTOVER_PATTERNS = ("sglang_loads_*", "sem.mp-*", "deepspeed_shm_*", "psm_*")


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def _mapped_shm() -> tuple[set[str], set[int]]:
    """Names and inodes under /dev/shm that some live process still maps or holds open. Inodes too: glibc's sem_open
    maps a temporary file it then renames, so /proc/PID/maps shows a POSIX semaphore (sem.mp-*) under another name."""
    used: set[str] = set()
    inodes: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for line in open(f"/proc/{pid}/maps", errors="replace"):
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
                    inodes.add(int(line.split()[4]))
        except (OSError, ValueError, IndexError):
            pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return used, inodes


def _in_use(name: str, used: set[str], inodes: set[int]) -> bool:
    try:
        return name in used or (SHM / name).stat().st_ino in inodes
    except OSError:
        return True  # gone already, or not ours to judge


def remove_leftover_shm(before: set[str] | None) -> list[str]:
    """Remove engine leftovers that appeared since `before` and no live process uses (another job's are kept)."""
    import fnmatch

    if before is None:
        return []
    new = [n for n in shm_entries() - before if any(fnmatch.fnmatch(n, p) for p in LEFTOVER_PATTERNS)]
    if not new:
        return []
    used, inodes = _mapped_shm()
    removed = []
    for name in new:
        if not _in_use(name, used, inodes):
            try:
                (SHM / name).unlink()
                removed.append(name)
            except OSError:
                pass
    return removed


class Server:
    """One engine server. managed=True: tied to us (log relay, killed with us); False: detached (keep_alive,
    retrain), run by a supervisor process (`supervisor.py`) that restarts it up to `restarts` times, each time
    waiting health_timeout seconds (serve.restarts and serve.health_timeout_s: a detached server needs both, and
    has no default of its own for either)."""

    def __init__(self, name: str, cmd: list[str], env: dict, base_url: str, log_path: Path,
                 redact: Callable[[str], str], on_line: Callable[[str], None] | None = None, managed: bool = True,
                 restarts: int | None = None, health_timeout: float | None = None):
        self.name, self.cmd, self.env, self.base_url = name, [str(c) for c in cmd], env, base_url
        self.log_path, self.redact, self.on_line, self.managed = log_path, redact, on_line, managed
        self.restarts, self.health_timeout = restarts, health_timeout
        self.state_path = log_path.with_name(log_path.stem + ".supervisor.json")
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.started_at = 0.0
        self.healthy_after: float | None = None
        self._shm_before: set[str] | None = None
        self._relay: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "Server":
        full_env = dict(os.environ)
        full_env.update({k: str(v) for k, v in self.env.items()})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("start %s server: %s", self.name, self.redact(" ".join(self.cmd)))
        self.started_at = time.time()
        self._shm_before = shm_entries()
        if self.managed:
            launch._install_signal_handlers()  # Ctrl-C / cancellation takes the server down too
            self.proc = subprocess.Popen(self.cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
                                         start_new_session=True, preexec_fn=launch._set_pdeathsig)
            with launch._active_lock:
                launch._active.add(self.proc)
            self._relay = threading.Thread(target=self._pump, name=f"{self.name}-log", daemon=True)
            self._relay.start()
        else:  # outlives this process: its supervisor writes the log (0600, secrets redacted) and restarts it
            full_env["BATON_REDACT"] = "\n".join(getattr(self.redact, "secrets", ()))
            self.state_path.unlink(missing_ok=True)
            if self.health_timeout is None or self.restarts is None:
                raise ValueError("a detached server needs its restarts and health timeout (serve.restarts, "
                                 "serve.health_timeout_s)")
            spec = events.write_spec(self.log_path.with_name(self.log_path.stem + ".supervisor-spec.json"),
                                     events.SupervisorSpec(name=self.name, log=self.log_path, state=self.state_path,
                                                           url=self.base_url, restarts=self.restarts,
                                                           health_timeout_s=self.health_timeout, cmd=self.cmd))
            supervisor = [sys.executable, str(Path(__file__).with_name("supervisor.py")), "--spec", str(spec)]
            sup_log = os.open(self.log_path.with_name(self.log_path.stem + ".supervisor.log"),
                              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self.proc = subprocess.Popen(supervisor, env=full_env, stdout=sup_log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            finally:
                os.close(sup_log)
        return self

    def _pump(self) -> None:
        assert self.proc and self.proc.stdout
        with open(self.log_path, "a", buffering=1) as f:
            for raw in self.proc.stdout:
                line = self.redact(raw.rstrip("\n"))
                f.write(line + "\n")
                self.tail.append(line)
                if self.on_line:
                    try:
                        self.on_line(line)
                    except Exception:
                        pass

    def wait_healthy(self, timeout: float) -> float:
        """Seconds until GET /health answered 200; raises ServerFailed if the server exits or time runs out."""
        try:
            wait_http_ok(self.base_url + "/health", timeout, alive=lambda: self.proc.poll() is None)
        except Unhealthy as e:
            if e.exited:
                time.sleep(0.5)  # let the relay drain the last lines
                raise ServerFailed(f"{self.name} server exited with code {self.proc.returncode} before it was "
                                   "healthy", self.log_tail()) from None
            tail = self.log_tail()
            self.stop()
            raise ServerFailed(f"{self.name} server not healthy after {timeout:.0f}s", tail) from None
        if not self.managed:
            self._wait_supervised(timeout)
        self.healthy_after = time.time() - self.started_at
        log.info("%s server healthy after %.1fs at %s", self.name, self.healthy_after, self.base_url)
        return self.healthy_after

    def _wait_supervised(self, timeout: float) -> None:
        """Until the supervisor itself saw the engine healthy (from then on it restarts an engine that dies)."""
        deadline = time.time() + timeout
        while self._engine()["status"] != "serving":
            if self.proc.poll() is not None or time.time() > deadline:
                tail = self.log_tail()
                self.stop()
                raise ServerFailed(f"{self.name} server's supervisor did not report it serving", tail)
            time.sleep(0.2)

    def log_tail(self) -> list[str]:
        if self.managed:
            return list(self.tail)
        try:
            return [self.redact(l) for l in self.log_path.read_text(errors="replace").splitlines()[-60:]]
        except OSError:
            return []

    def stop(self) -> None:
        if self.proc is None:
            return
        engine = None if self.managed else self._engine()
        launch.kill_tree(self.proc, grace=15.0 if self.managed else 30.0)  # a supervisor first stops its engine
        if engine and engine.get("engine_pid"):
            if same_process(engine["engine_pid"], engine.get("engine_started_at")):
                launch.kill_group(int(engine["engine_pid"]), 15.0)
        with launch._active_lock:
            launch._active.discard(self.proc)
        if self._relay is not None:
            self._relay.join(timeout=5)
        removed = remove_leftover_shm(self._shm_before)
        if removed:
            log.info("%s: removed %d shared-memory leftovers (%s)", self.name, len(removed), ", ".join(removed[:5]))

    def _engine(self) -> dict:
        """The engine a supervisor runs now (pid and start time, from its state file)."""
        state = read_json(self.state_path) or {}
        return {k: state.get(k) for k in ("engine_pid", "engine_started_at", "status")}

    def describe(self) -> dict:
        """What a user needs to reach or stop a detached server (no secret in it): pid is the supervisor's (or the
        engine's, when managed); with its start time a later stop signals only this very process."""
        out = {"engine": self.name, "pid": self.proc.pid if self.proc else None, "base_url": self.base_url,
               "log": str(self.log_path), "stop": f"kill -- -{self.proc.pid}" if self.proc else None,
               "started_at": self._started_at()}
        if not self.managed:
            engine = self._engine()
            out.update(engine_pid=engine["engine_pid"], engine_started_at=engine["engine_started_at"],
                       state=str(self.state_path), restarts=self.restarts)
        return out

    def _started_at(self) -> float | None:
        import psutil

        try:
            return psutil.Process(self.proc.pid).create_time() if self.proc else None
        except psutil.Error:
            return None

    def write_info(self, path: Path) -> None:
        from conversions import durable

        durable.write_json(path, self.describe())

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
