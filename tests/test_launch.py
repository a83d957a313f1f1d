"""The launcher streams events, reports failures with their last lines, and leaves no process behind."""
import os
import sys
import textwrap
import time

import psutil
import pytest

from tasks import launch


def _script(tmp_path, body: str):
    p = tmp_path / "w.py"
    p.write_text(textwrap.dedent(body))
    return [sys.executable, str(p)]


def test_events_and_lines_are_streamed(tmp_path):
    cmd = _script(tmp_path, """
        import sys; sys.path.insert(0, %r)
        from tasks import events
        print("hello")
        for s in range(3):
            events.metric(s, {events.TRAIN_LOSS: 3.0 - s})
        events.progress(3, 3)
        events.emit("result", answer=42)
    """ % os.getcwd())
    lines, evs = [], []
    res = launch.run(cmd, on_line=lines.append, on_event=evs.append, log_path=tmp_path / "log")
    assert res.returncode == 0 and "hello" in lines
    assert [e["train/loss"] for e in res.metrics()] == [3.0, 2.0, 1.0]
    assert res.results() == {"answer": 42}
    assert "hello" in (tmp_path / "log").read_text()


def test_a_worker_result_is_read_back_into_its_model_or_refused():
    """The result contract: one `result` event, read back into its stage's model; a field the model lacks (a worker
    and a task that disagree) or a second result event fails the read, naming it."""
    from pydantic import ValidationError

    from tasks import events

    class Facts(events.WorkerResult):
        steps: int
        before: float | None

    def read(*results: dict):
        return launch.LaunchResult(0, events=[{"kind": "metric", "step": 1}]
                                   + [{"kind": "result", **r} for r in results]).result(Facts)

    assert read({"steps": 3, "before": None}) == Facts(steps=3, before=None)
    with pytest.raises(ValidationError, match="stepz"):
        read({"steps": 3, "before": 1.0, "stepz": 3})
    with pytest.raises(RuntimeError, match="2 result events"):
        read({"steps": 3, "before": 1.0}, {"steps": 3, "before": 1.0})


def test_failure_carries_exit_code_and_tail(tmp_path):
    cmd = _script(tmp_path, """
        print("step 1 ok")
        raise SystemExit("boom: out of patience")
    """)
    with pytest.raises(launch.LaunchError) as e:
        launch.run(cmd)
    assert e.value.returncode == 1 and any("boom" in line for line in e.value.tail)
    assert "step 1 ok" in str(e.value)


def test_timeout_kills_the_whole_tree(tmp_path):
    pidfile = tmp_path / "pids"
    cmd = _script(tmp_path, """
        import subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) for _ in range(2)]
        open(%r, "w").write(" ".join(str(k.pid) for k in kids))
        print("started", flush=True)
        time.sleep(300)
    """ % str(pidfile))
    t0 = time.time()
    with pytest.raises(launch.LaunchError, match="timed out"):
        launch.run(cmd, timeout=3)
    assert time.time() - t0 < 30
    deadline = time.time() + 15  # a killed process can take a moment to be reaped on a loaded machine
    while time.time() < deadline and any(_sleeper_alive(int(p)) for p in pidfile.read_text().split()):
        time.sleep(0.2)
    assert not any(_sleeper_alive(int(p)) for p in pidfile.read_text().split())


def _sleeper_alive(pid: int) -> bool:
    """Our grandchild still running (not a zombie, and not some later process that reused its pid)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "time.sleep(300)" in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return False
