"""Detached servers are supervised (issue 12, item 6) and a retrain that dies between its steps is reconciled (item 2),
for real: real supervisor processes (`tasks/serve/supervisor.py`) around a real HTTP engine process, the real MLflow
registry, serving.json, SIGKILLs. The same on vLLM with the tiny model: tests/test_serve_supervised.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from conftest import REPO
from flows import retrain
from tasks import tracking
from tasks.serve import supervisor
from tasks.serve.server import SHM, Server, free_port

pytestmark = [pytest.mark.slow, pytest.mark.reliability]  # supervisor processes + MLflow: ~35 s
NAME = "supervised"

ENGINE = """
import http.server, mmap, os, sys
port, shm = int(sys.argv[1]), sys.argv[2]
fd = os.open('/dev/shm/' + shm, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
keep = mmap.mmap(fd, 4096)  # like an engine's weight segment: left behind when it is killed
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(str(os.getpid()).encode())
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def detached(tmp_path, tag: str, restarts: int) -> tuple[Server, str]:
    """A supervised detached server, as serve.keep_alive and retrain start one (healthy when returned)."""
    port = free_port("127.0.0.1")
    shm = f"sem.mp-{tag}-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / tag
    folder.mkdir()
    server = Server("engine", [sys.executable, "-c", ENGINE, str(port), shm], {}, f"http://127.0.0.1:{port}",
                    folder / "server-engine.log", str, managed=False, restarts=restarts, health_timeout=60)
    server.start()
    server.wait_healthy(60)
    return server, shm


def answers(base_url: str) -> int:
    with urllib.request.urlopen(base_url + "/health", timeout=10) as r:
        return int(r.read())


def wait_for(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def state(server: Server) -> dict:
    return supervisor.read_json(server.state_path) or {}


def gone(pid) -> bool:
    return not supervisor.running(pid, None)  # exited (a zombie whose parent died may wait for its reaper)


def versions(tmp_path, n: int) -> list[str]:
    c = tracking.client()
    out = []
    for i in range(n):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        out.append(str(tracking.register_checkpoint(c, NAME, folder, None, tags={"i": i}, alias=None)))
    return out


def champion() -> str:
    return str(tracking.client().get_model_version_by_alias(NAME, tracking.CHAMPION).version)


def test_detached_server_restarted_then_down_and_champion_rolled_back(tmp_path, baton_home, record_property):
    """serving.json's server: its engine SIGKILLed is restarted and answers again (serving.json follows the new engine
    pid); killed once more than serve.restarts allows, the supervisor exits 3, serving.json says down, and the
    champion it served is rolled back by compare-and-set, as `baton serve` does."""
    record_property("fault", "detached server's engine killed")
    v1, v2 = versions(tmp_path, 2)
    c = tracking.client()
    tracking.promote_champion(c, NAME, v1)
    tracking.promote_champion(c, NAME, v2)
    server, shm = detached(tmp_path, "promoted", restarts=1)
    try:
        retrain.switch_serving(NAME, {"version": v2, "server": server.describe()})  # what retrain does after the CAS
        first = state(server)["engine_pid"]
        assert answers(server.base_url) == first == retrain.serving()["server"]["engine_pid"]
        os.killpg(first, signal.SIGKILL)
        wait_for(lambda: state(server).get("restarts_used") == 1 and state(server)["status"] == "serving",
                 what="the restarted engine healthy")
        # the supervisor records the new engine's pid in STATE, then in serving.json ("restarting", then "serving")
        wait_for(lambda: (now := retrain.serving())["server"]["engine_pid"] == state(server)["engine_pid"]
                 and now["status"] == "serving", what="serving.json")
        second = state(server)["engine_pid"]
        wait_for(lambda: answers(server.base_url) == second, what="the restarted engine to answer")
        assert retrain.serving()["status"] == "serving" and champion() == v2

        os.killpg(second, signal.SIGKILL)
        assert server.proc.wait(120) == supervisor.GAVE_UP
        assert state(server)["status"] == "down" and state(server)["exit_code"] == -signal.SIGKILL
        assert retrain.serving()["status"] == "down" and not supervisor.alive(retrain.serving()["server"])
        assert champion() == v1, "the champion whose server kept dying was not rolled back"
        assert gone(first) and gone(second) and not (SHM / shm).exists()
    finally:
        server.stop()


def test_stop_serving_leaves_no_process_and_no_shm(tmp_path, baton_home, record_property):
    record_property("fault", "(control) stop a supervised server")
    server, shm = detached(tmp_path, "stopped", restarts=2)
    try:
        retrain.switch_serving(NAME, {"version": "1", "server": server.describe()}, promoted=False)
        engine = state(server)["engine_pid"]
        assert (SHM / shm).exists() and answers(server.base_url) == engine
        retrain.stop_serving()
        assert server.proc.wait(10) == 0  # stopped, not given up: no rollback, no "down"
        assert gone(server.proc.pid) and gone(engine)
        assert not (SHM / shm).exists(), "the engine's /dev/shm segment outlived it"
        assert retrain.serving() is None and state(server)["status"] == "stopped"
    finally:
        server.stop()


def test_a_server_whose_run_folder_is_deleted_stops(tmp_path, baton_home, record_property):
    """BATON_HOME removed under a detached server (a test's or a user's `rm -rf`): nobody can find, stop or
    reconcile it any more, so its supervisor takes the engine down instead of holding the port and memory."""
    import shutil

    record_property("fault", "run folder deleted under a detached server")
    server, shm = detached(tmp_path, "orphaned", restarts=2)
    try:
        engine = state(server)["engine_pid"]
        assert answers(server.base_url) == engine
        shutil.rmtree(server.state_path.parent)
        assert server.proc.wait(30) == 0
        assert gone(engine) and not (SHM / shm).exists()
    finally:
        server.stop()


# A retrain's switch, step by step with the real functions, in a process SIGKILLed at the chosen point. The two
# servers stand in for start_serving's (the same supervisor and records; start_serving itself is the serve stage).
CRASHING_RETRAIN = """
import json, os, signal, sys
sys.path.insert(0, {repo!r})
sys.path.insert(0, {tests!r})
from pathlib import Path
from flows import retrain
from tasks import tracking
from test_reliability_supervise import detached
tmp = Path({tmp!r})
old, _ = detached(tmp, "old", restarts=2)
retrain.switch_serving({name!r}, {{"version": {v1!r}, "server": old.describe()}}, promoted=False)
new, _ = detached(tmp, "candidate", restarts=2)
retrain.record_candidate({{"version": {v2!r}, "server": new.describe()}})
if {move_alias!r}:
    tracking.promote_champion(tracking.client(), {name!r}, {v2!r}, expected={v1!r})
print(json.dumps({{"old": old.describe(), "new": new.describe()}}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies before stopping the old server and publishing the candidate
"""


@pytest.mark.parametrize("move_alias", [True, False], ids=["after-alias-moved", "before-alias-moved"])
def test_retrain_killed_mid_switch_is_reconciled(tmp_path, baton_home, move_alias, record_property):
    record_property("fault", "retrain SIGKILLed mid-switch")
    v1, v2 = versions(tmp_path, 2)
    tracking.promote_champion(tracking.client(), NAME, v1)
    code = CRASHING_RETRAIN.format(repo=str(REPO), tests=str(REPO / "tests"), tmp=str(tmp_path), name=NAME, v1=v1,
                                   v2=v2, move_alias=move_alias)
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    servers = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        before = retrain.serving()
        assert str(before["version"]) == v1 and before["candidate"]["version"] == v2
        assert supervisor.alive(servers["old"]) and supervisor.alive(servers["new"])
        champ = {"version": champion(), "path": str(tmp_path)}
        did = retrain.reconcile_serving(None, None, champ, NAME)  # what the next retrain run does first
        after = retrain.serving()
        kept, stopped = ("new", "old") if move_alias else ("old", "new")
        assert "candidate" not in after and after["server"]["pid"] == servers[kept]["pid"], did
        assert str(after["version"]) == (v2 if move_alias else v1)
        assert supervisor.alive(servers[kept]) and answers(servers[kept]["base_url"])
        assert gone(servers[stopped]["pid"]) and gone(servers[stopped]["engine_pid"])
        assert ("switched to candidate" in did) if move_alias else did == "stopped a leftover candidate server"
        promoted = supervisor.read_json(tmp_path / "candidate" / supervisor.PROMOTED)
        assert (promoted == {"name": NAME, "version": v2}) if move_alias else promoted is None
        assert retrain.reconcile_serving(None, None, champ, NAME) is None  # agreed: nothing more to do
    finally:
        retrain.stop_serving()
        for s in servers.values():
            supervisor.stop_recorded(s)
