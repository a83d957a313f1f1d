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
