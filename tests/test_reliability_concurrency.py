"""Concurrency and crash safety (issue 12, items 1 and 3) with real `baton run` processes and real files: a second
run of a step waits for the live owner (or refuses with --no-wait, naming it), takes over only once the owner is dead,
and the index and manifests survive torn writes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, TINY, baton, mlflow_client
from conversions import durable, manifest as mf
from flows.runs import Index, StepLock

pytestmark = pytest.mark.reliability


def _start(home, *args):
    env = dict(os.environ, BATON_HOME=str(home))
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY), "--stages", "data", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for(pred, timeout, what, evidence=lambda: ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{evidence()}")


def _step_running(home) -> bool:
    return any(json.loads(p.read_text()).get("status") == "running" for p in (home / "index").glob("*.json")) \
        if (home / "index").exists() else False


def _log_tails(home) -> str:
    return "\n".join(f"== {log}\n{log.read_text(errors='replace')[-1500:]}" for log in (home / "runs").rglob("*.log"))


def _owners(home):
    return [json.loads(p.read_text()) for p in (home / "locks").glob("*.owner.json")] if (home / "locks").exists() else []


def _said_it_waits(home, owner_pid: int) -> bool:
    """A run's log says it waits for the step's owner (it is not running the step beside it)."""
    return any(f"being run by pid {owner_pid}" in log.read_text(errors="replace") and "waiting" in
               log.read_text(errors="replace") for log in (home / "runs").rglob("*.log"))


@pytest.mark.slow
def test_second_run_waits_refuses_and_takes_over_only_a_dead_owner(baton_home, record_property):
    """The first run is frozen (SIGSTOP) as soon as it holds the data step's lock: alive, so its lock and folder are
    never taken; once it is SIGKILLed the waiting run takes the step over in the same folder and completes it."""
    record_property("fault", "concurrent run of one step")
    first = _start(baton_home)
    try:
        _wait_for(lambda: any(o["pid"] == first.pid for o in _owners(baton_home)), 300, "the first run's lock")
        # frozen inside the step's work, not between the lock and its tracking writes: a process stopped mid-write to
        # the local SQLite tracking store would hold every other writer of that store (the waiting run included)
        _wait_for(lambda: _step_running(baton_home), 120, "the first run's step to start its work")
        os.kill(first.pid, signal.SIGSTOP)
        refused = baton("run", str(TINY), "--stages", "data", "--no-wait", home=baton_home, timeout=300)
        assert refused.returncode != 0
        assert f"being run by pid {first.pid}" in refused.stderr + refused.stdout
        assert len(list((baton_home / "runs").iterdir())) == 1  # refused before it wrote anything
        second = _start(baton_home)
        _wait_for(lambda: _said_it_waits(baton_home, first.pid), 120, "the second run to wait on the lock",
                  lambda: _log_tails(baton_home))
        assert second.poll() is None and {o["pid"] for o in _owners(baton_home)} == {first.pid}
        os.killpg(first.pid, signal.SIGKILL)  # the owner dies mid-step: its lock goes with it
        first.wait(60)
        out, _ = second.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert second.returncode == 0, out[-3000:]
    assert "completed" in out
    assert not _owners(baton_home)  # released
    records = [json.loads(p.read_text()) for p in (baton_home / "index").glob("*.json")]
    assert [r["status"] for r in records] == ["completed"]
    # the dead owner ran no cleanup: the run that took its step over closed its records
    (dead,) = [json.loads(p.read_text()) for p in (baton_home / "runs").glob("*/summary.json")
               if json.loads(p.read_text())["run_id"] != records[0]["run_id"]]
    assert dead["status"] == "crashed", dead
    c = mlflow_client(baton_home)
    runs = c.search_runs([c.get_experiment_by_name("baton").experiment_id],
                         filter_string=f"tags.`baton.run_id` = '{dead['run_id']}'")
    assert runs and {r.info.status for r in runs} == {"KILLED"}, [(r.data.tags, r.info.status) for r in runs]


@pytest.mark.fast
def test_lock_held_by_a_live_process_is_never_taken(tmp_path, record_property):
    record_property("fault", "step lock: live vs dead owner")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from pathlib import Path; from flows.runs import StepLock\n"
        "held = StepLock('fp1', root=Path(%r)).acquire('holder'); print('held', flush=True); time.sleep(60)"
    ) % (str(REPO), str(tmp_path))], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from flows.runs import StepBusy
        with pytest.raises(StepBusy, match=f"pid {holder.pid} on"):
            StepLock("fp1", root=tmp_path).acquire("me", wait=False)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        lock = StepLock("fp1", root=tmp_path).acquire("me", wait=False)  # a dead owner's lock is taken over
        assert lock.owner()["pid"] == os.getpid()
        lock.release()
    finally:
        if holder.poll() is None:
            holder.kill()


@pytest.mark.fast
def test_torn_index_record_is_absent_with_a_warning(tmp_path, caplog, record_property):
    record_property("fault", "torn index record")
    idx = Index(tmp_path)
    idx.put("fp", status="completed", output="x")
    (tmp_path / "index" / "fp.json").write_text('{"fingerprint": "fp", "stat')  # a crash mid-write (old code)
    assert idx.get("fp") is None
    assert "unreadable index record" in caplog.text
    idx.put("fp", status="running")
    assert idx.get("fp")["status"] == "running"


@pytest.mark.fast
def test_writer_killed_mid_write_leaves_the_old_content(tmp_path, record_property):
    record_property("fault", "writer SIGKILLed mid-write")
    """A real process SIGKILLed while writing a 64 MB record through durable.write_bytes: the target keeps its old
    content and the only trace is a uniquely named tmp file (no shared tmp name another writer could clobber)."""
    target = tmp_path / "record.json"
    durable.write_json(target, {"v": 1})
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r)\n"
        "from conversions import durable\n"
        "print('go', flush=True)\n"
        "for i in range(1000): durable.write_bytes(%r, b'x' * (64 << 20))\n"
    ) % (str(REPO), str(target))], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "go"
    time.sleep(1.0)
    writer.kill()
    writer.wait(10)
    data = target.read_bytes()
    assert data == b'{\n  "v": 1\n}\n' or data == b"x" * (64 << 20)  # old or whole new, never torn


@pytest.mark.fast
def test_manifest_tmp_of_a_crashed_write_is_not_part_of_the_checkpoint(tmp_path, record_property):
    record_property("fault", "crashed manifest write")
    (tmp_path / "w.bin").write_bytes(b"abc")
    mf.write(tmp_path, mf.build(tmp_path, format="dataset", stage="test"))
    (tmp_path / f".{mf.MANIFEST_NAME}.abcd.tmp").write_text("{")  # left by a writer killed before its rename
    from conversions import verify
    assert verify.integrity(tmp_path)[0]["passed"]


@pytest.mark.fast
def test_publish_dir_refuses_to_replace_a_published_folder(tmp_path, record_property):
    record_property("fault", "rewrite of a published folder")
    final = tmp_path / "ckpt"
    part = durable.partial_of(final)
    part.mkdir()
    (part / "a").write_text("1")
    durable.publish_dir(part, final)
    again = durable.partial_of(final)
    again.mkdir()
    with pytest.raises(FileExistsError, match="already published"):
        durable.publish_dir(again, final)
    assert (final / "a").read_text() == "1"
