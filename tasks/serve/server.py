"""A long-running engine server: start it in its own process group, stream its (redacted) log, wait for /health,
and stop the whole group. Unlike `tasks.launch.run`, the caller keeps working while the server runs."""
from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from tasks import launch
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

    return redact


class Server:
    """One engine server. managed=True: tied to us (log relay, killed with us); False: detached (keep_alive)."""

    def __init__(self, name: str, cmd: list[str], env: dict, base_url: str, log_path: Path,
                 redact: Callable[[str], str], on_line: Callable[[str], None] | None = None, managed: bool = True):
        self.name, self.cmd, self.env, self.base_url = name, [str(c) for c in cmd], env, base_url
        self.log_path, self.redact, self.on_line, self.managed = log_path, redact, on_line, managed
        self.proc: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.started_at = 0.0
        self.healthy_after: float | None = None
        self._relay: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> "Server":
        full_env = dict(os.environ)
        full_env.update({k: str(v) for k, v in self.env.items()})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("start %s server: %s", self.name, self.redact(" ".join(self.cmd)))
        self.started_at = time.time()
        if self.managed:
            launch._install_signal_handlers()  # Ctrl-C / cancellation takes the server down too
            self.proc = subprocess.Popen(self.cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, text=True, bufsize=1, errors="replace",
                                         start_new_session=True, preexec_fn=launch._set_pdeathsig)
            with launch._active_lock:
                launch._active.add(self.proc)
            self._relay = threading.Thread(target=self._pump, name=f"{self.name}-log", daemon=True)
            self._relay.start()
        else:  # outlives this process: the engine writes its own log (0600, beside the 0600 key file)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self.proc = subprocess.Popen(self.cmd, env=full_env, stdout=fd, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
            os.close(fd)
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
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.5)  # let the relay drain the last lines
                raise ServerFailed(f"{self.name} server exited with code {self.proc.returncode} before it was "
                                   "healthy", self.log_tail())
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.healthy_after = time.time() - self.started_at
                        log.info("%s server healthy after %.1fs at %s", self.name, self.healthy_after, self.base_url)
                        return self.healthy_after
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        tail = self.log_tail()
        self.stop()
        raise ServerFailed(f"{self.name} server not healthy after {timeout:.0f}s", tail)

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
        launch.kill_tree(self.proc, grace=15.0)
        with launch._active_lock:
            launch._active.discard(self.proc)
        if self._relay is not None:
            self._relay.join(timeout=5)

    def describe(self) -> dict:
        """What a user needs to reach or stop a detached server (no secret in it)."""
        return {"engine": self.name, "pid": self.proc.pid if self.proc else None, "base_url": self.base_url,
                "log": str(self.log_path), "stop": f"kill -- -{self.proc.pid}" if self.proc else None}

    def write_info(self, path: Path) -> None:
        path.write_text(json.dumps(self.describe(), indent=2) + "\n")

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
