"""Leftovers (issue 12, item 9), for real: an engine server that dies holding /dev/shm segments and semaphores
(what SGLang leaves: sglang_loads_*, sem.mp-*) has them removed when it is stopped; a live process's are kept."""
from __future__ import annotations

import os
import sys
import time
import uuid

import pytest

from tasks.serve.server import SHM, Server

pytestmark = [pytest.mark.fast, pytest.mark.reliability]

ENGINE = """
import mmap, os, sys, time
for name in sys.argv[1:]:
    fd = os.open('/dev/shm/' + name, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    keep = mmap.mmap(fd, 4096)  # mapped, like a loaded weight segment
print('ready', flush=True)
time.sleep(600)
"""


def test_engine_shm_leftovers_are_removed_but_not_a_live_jobs(tmp_path, record_property):
    record_property("fault", "engine killed holding /dev/shm")
    tag = uuid.uuid4().hex[:8]
    ours = [f"sglang_loads_{tag}.shm", f"sem.mp-{tag}"]
    theirs = f"sglang_loads_{tag}_other.shm"
    other = Server("other", [sys.executable, "-c", ENGINE, theirs], {}, "http://127.0.0.1:9", tmp_path / "o.log",
                   str, managed=True)
    server = Server("sglang", [sys.executable, "-c", ENGINE, *ours], {}, "http://127.0.0.1:9", tmp_path / "s.log",
                    str, managed=True)
    try:
        server.start()
        other.start()
        deadline = time.time() + 60
        while time.time() < deadline and not all((SHM / n).exists() for n in ours + [theirs]):
            time.sleep(0.2)
        assert all((SHM / n).exists() for n in ours + [theirs])
        server.stop()  # SIGTERM/SIGKILL of its process group: nothing of the engine's own cleanup runs
        assert not any((SHM / n).exists() for n in ours)
        assert (SHM / theirs).exists(), "another live job's segment was removed"
    finally:
        server.stop()
        other.stop()
        for n in ours + [theirs]:
            try:
                os.unlink(SHM / n)
            except FileNotFoundError:
                pass


HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_held_server_is_restarted_then_gives_up_with_its_exit_code(tmp_path, record_property):
    """`baton serve`'s supervision on a real HTTP server process: SIGKILLed three times with restarts=2, it is
    restarted twice (healthy again each time), then the exit code comes back (non-zero)."""
    import signal
    import threading

    from tasks.serve.server import free_port
    from tasks.serve.task import _hold

    record_property("fault", "served engine killed")
    port = free_port("127.0.0.1")
    server = Server("engine", [sys.executable, "-c", HEALTH_SERVER, str(port)], {}, f"http://127.0.0.1:{port}",
                    tmp_path / "engine.log", str, managed=True)
    server.start()
    server.wait_healthy(60)
    pids = []

    def kill_three_times():
        for _ in range(3):
            deadline = time.time() + 60
            while time.time() < deadline and (server.proc is None or server.proc.pid in pids
                                              or server.healthy_after is None):
                time.sleep(0.2)
            time.sleep(0.5)
            pids.append(server.proc.pid)
            server.healthy_after = None
            os.killpg(server.proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_three_times)
    killer.start()
    code = _hold(server, "m", tmp_path / "key", restarts=2, health_timeout=60)
    killer.join(60)
    assert code == -signal.SIGKILL and len(set(pids)) == 3
    assert server.proc.poll() is not None


def test_detached_server_log_is_redacted(tmp_path, record_property):
    """A keep_alive server outlives baton: its log is still written without the API key (and 0600)."""
    import stat

    from tasks.serve.server import redactor

    record_property("fault", "API key printed by a detached engine")
    key = "baton-" + uuid.uuid4().hex
    log = tmp_path / "server.log"
    code = (f'import os; print("server_args api_key={key!r}", flush=True); '
            'print("env", "BATON_REDACT" in os.environ)')
    server = Server("vllm", [sys.executable, "-c", code], {}, "http://127.0.0.1:9", log, redactor(key), managed=False,
                    restarts=0, health_timeout=60)
    server.start()
    try:
        server.proc.wait(60)
    finally:
        server.stop()
    text = log.read_text()
    assert "api_key='***'" in text and key not in text and "env False" in text
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_a_live_jobs_posix_semaphore_is_kept(record_property):
    """glibc maps a semaphore under a temporary name (`/dev/shm/sem.XXXXXX (deleted)` in /proc/PID/maps): found by
    inode, a live job's `sem.mp-*` is not removed by another server's cleanup (it broke a concurrent vLLM start)."""
    import multiprocessing

    from tasks.serve.server import remove_leftover_shm, shm_entries

    record_property("fault", "stop beside a live job's semaphore")
    before = shm_entries()
    lock = multiprocessing.get_context("spawn").Lock()
    name = "sem." + lock._semlock.name.lstrip("/")
    assert (SHM / name).exists()
    assert name not in remove_leftover_shm(before) and (SHM / name).exists()
