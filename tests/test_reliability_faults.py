"""Fault classes (issue 12, item 4), each produced for real by a real process: only a rank killed by a signal or a
lost peer is retried; an OOM kill (a real memory cgroup), a full disk (/dev/full), a non-finite loss and an ordinary
exception fail at once, with their cause in the message."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flows import stages
from tasks import launch

pytestmark = [pytest.mark.fast, pytest.mark.reliability]


def _fail(code: str, env: dict | None = None) -> launch.LaunchError:
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-c", code], name="rank", timeout=120, env=env)
    return info.value


def test_rank_killed_by_a_signal_is_infrastructure(record_property):
    record_property("fault", "rank SIGKILLed")
    e = _fail("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert stages.failure_class(e, stages.oom_kills()) == "infrastructure"


@pytest.mark.slow
def test_lost_peer_is_infrastructure(record_property, tmp_path):
    """Two real gloo ranks; rank 1 dies, rank 0 loses its peer mid all_reduce."""
    record_property("fault", "lost peer")
    code = (
        "import os, signal, torch, torch.distributed as dist\n"
        "rank = int(os.environ['RANK'])\n"
        "dist.init_process_group('gloo', init_method='file://%s', rank=rank, world_size=2)\n"
        "dist.barrier()\n"
        "if rank == 1: os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(torch.ones(1))\n"
    ) % (tmp_path / "rendezvous")
    script = tmp_path / "rank.py"
    script.write_text(code)
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(launch_port()), str(script)], name="ranks", timeout=180, env={"OMP_NUM_THREADS": "1"})
    assert stages.failure_class(info.value, stages.oom_kills()) == "infrastructure", info.value.tail[-10:]


def launch_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_disk_full_is_not_retried(record_property):
    record_property("fault", "ENOSPC in a rank")
    e = _fail("open('/dev/full', 'w').write('x' * 100000)")
    assert stages.failure_class(e, stages.oom_kills()) == "disk full"


def test_ordinary_exception_is_not_retried(record_property):
    record_property("fault", "ordinary exception")
    e = _fail("raise ValueError('a bug')")
    assert stages.failure_class(e, stages.oom_kills()) == "error"


def test_non_finite_loss_beats_the_peers_lost_connection(record_property):
    """A rank that stops on a NaN loss takes its peers down with 'Connection closed by peer': still not retried."""
    record_property("fault", "non-finite loss")
    e = _fail("import sys; print('[rank1] Connection closed by peer', flush=True); "
              "sys.exit('rank 0: non-finite loss nan at step 7 (micro-batch 0)')")
    assert stages.failure_class(e, stages.oom_kills()) == "non-finite loss"
    assert "step 7" in "\n".join(e.tail)


def _child_memory_cgroup(limit: int) -> Path | None:
    root = stages._memory_cgroup()
    if root is None or not root.exists():
        return None
    child = root / f"baton-test-{os.getpid()}"
    try:
        child.mkdir()
        name = "memory.limit_in_bytes" if (child / "memory.limit_in_bytes").exists() else "memory.max"
        (child / name).write_text(str(limit))
    except OSError:
        return None
    return child


def test_oom_kill_is_not_retried(record_property):
    """A rank in a 64 MB memory cgroup allocates 400 MB: the kernel's OOM killer SIGKILLs it. Without the cgroup's
    oom_kill counter this would look exactly like a preempted rank."""
    record_property("fault", "OOM kill")
    cg = _child_memory_cgroup(64 << 20)
    if cg is None:
        pytest.skip("cannot create a memory cgroup here")
    try:
        before = stages.oom_kills()
        e = _fail(f"import os; open({str(cg / 'cgroup.procs')!r}, 'w').write(str(os.getpid()));"
                  "x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096])")
        assert e.returncode in (-9, 137)
        assert stages.failure_class(e, before) == "out of memory"
    finally:
        cg.rmdir()


def test_timeout_is_not_retried(record_property):
    record_property("fault", "hung rank (timeout)")
    with pytest.raises(launch.LaunchError) as info:
        launch.run([sys.executable, "-c", "import time; time.sleep(60)"], name="rank", timeout=2)
    assert stages.failure_class(info.value) == "timeout"
