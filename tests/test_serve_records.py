"""A recorded server pid is signalled only while it is still the recorded process (docs/reliability-and-security.md,
"Champion moves"): a record whose pid is alive but started at another time names a process that reused the pid, and
stopping the record leaves that process alone. A real child process each time, in its own process group."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tasks.serve import records, supervisor

pytestmark = pytest.mark.fast
HOUR = 3600.0  # far outside same_process's tolerance of a second


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def test_a_live_pid_with_another_start_time_is_not_the_recorded_process(child):
    started = records.started_at(child.pid)
    assert started is not None
    assert records.same_process(child.pid, started) and records.running(child.pid, started)
    for other in (started - HOUR, started + HOUR):
        assert not records.same_process(child.pid, other) and not records.running(child.pid, other)


def test_stopping_a_record_signals_its_pid_only_while_the_start_time_matches(child, tmp_path):
    started = records.started_at(child.pid)
    supervisor.stop_recorded({"pid": child.pid, "started_at": started - HOUR, "state": str(tmp_path / "none.json")},
                             grace=5)
    assert child.poll() is None, "a pid reused since the record was signalled"
    supervisor.stop_recorded({"pid": child.pid, "started_at": started, "state": str(tmp_path / "none.json")}, grace=5)
    assert child.wait(30) is not None and not records.running(child.pid, started)
