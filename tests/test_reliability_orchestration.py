"""The Prefect server a run reports to goes away mid-stage (issue 40), for real: a Prefect server started for the test
is killed while a stage trains and never restarted. The run goes on without it and ends as it would have."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from outage import wait_for_line

from tasks import orchestration, tracking

pytestmark = [pytest.mark.ops, pytest.mark.reliability]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server():
    """A Prefect server of the test's own (the session's database, its own port and process), which it may kill."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer(port=_free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.long
@pytest.mark.timeout(900)
def test_a_run_finishes_when_its_prefect_server_is_gone_mid_stage(prefect_server, baton_home, hf_checkpoint, tmp_path,
                                                                  record_property):
    """Killed while finetune trains, never restarted: finetune completes, the conversion after it runs, summary.json
    is final and true (what Prefect never got listed), the MLflow parent run FINISHED, rc 0, and baton exits soon
    after the engine (before: the stage subflow's end raised httpx.ConnectError after minutes of Prefect's retries,
    the conversion never ran, rc 1, summary.json "running")."""
    from conftest import REPO, TINY

    record_property("fault", "Prefect server killed mid-stage, never restarted")
    home = baton_home
    cmd = [sys.executable, "-m", "flows.cli", "run", str(TINY), "--stages", "data,finetune", "--from",
           str(hf_checkpoint), "--no-doctor", "--set", "finetune.steps=40", "--set", "finetune.nproc_per_node=1",
           "--set", "finetune.checkpoint_every=40"]
    env = dict(os.environ, BATON_HOME=str(home), PREFECT_API_URL=prefect_server.api_url)
    env.pop("PREFECT_CLIENT_MAX_RETRIES", None)  # baton's own bound
    with open(tmp_path / "baton.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        engine_log = wait_for_line("runs/*/*-finetune/engine.log", home, '"kind": "metric"', proc, 600)
        prefect_server.server_process.kill()  # as a stopped stack leaves it: nothing listens on the port
        prefect_server.server_process.wait(30)
        wait_for_line("runs/*/*-finetune/engine.log", home, '"kind": "result"', proc, 600)
        engine_done = time.time()
        rc = proc.wait(timeout=300)
        after_engine = time.time() - engine_done
    finally:
        if proc.poll() is None:
            proc.kill()
    output = (tmp_path / "baton.out").read_text(errors="replace")
    print(f"baton exited {after_engine:.1f}s after the engine's result")
    assert rc == 0, output[-4000:]
    summary = json.loads((engine_log.parent.parent / "summary.json").read_text())
    statuses = {s["label"]: s["status"] for s in summary["stages"]}
    assert summary["status"] == "completed" and set(statuses.values()) == {"completed"}, statuses
    (finetune, convert) = [s for s in summary["stages"] if s["label"] != "data"]
    assert finetune[orchestration.ORCHESTRATION_LOST] == [orchestration.STAGE_SUBFLOW_END], finetune
    assert convert[orchestration.ORCHESTRATION_LOST] == [orchestration.STAGE_SUBFLOW], convert
    assert convert["prefect_flow_run_id"] is None and Path(convert["output"]).is_dir()
    assert summary[orchestration.ORCHESTRATION_LOST] == orchestration.RUN_END, summary
    assert tracking.client().get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    assert "went away during the run" in output and "Connection refused" not in output, output[-3000:]
    assert after_engine < 90, f"baton exited {after_engine:.0f}s after the engine's result"


@pytest.mark.fast
def test_an_outage_is_told_by_type_and_status_never_by_text(record_property):
    """What marks the Prefect server lost: a transport error or a 502/503/504; a refusal (401: another stack's
    credentials) or an error that only says "Connection refused" is not an outage."""
    import httpx

    record_property("fault", "Prefect server errors classified")
    request = httpx.Request("POST", "http://127.0.0.1:1/api/flow_runs/")

    def status(code: int) -> httpx.HTTPStatusError:
        return httpx.HTTPStatusError("", request=request, response=httpx.Response(code, request=request))

    assert orchestration.is_outage(httpx.ConnectError("", request=request))
    assert orchestration.is_outage(httpx.ReadTimeout("", request=request))
    assert orchestration.is_outage(status(503)) and not orchestration.is_outage(status(401))
    assert not orchestration.is_outage(RuntimeError("[Errno 111] Connection refused"))


@pytest.mark.fast
def test_once_the_server_is_lost_prefect_is_not_retried_until_the_next_run(record_property):
    """mark_lost: Prefect's calls are no longer retried, no log goes to the server, new events are dropped; reset()
    (a pipeline flow's start) puts all of it back."""
    import logging

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogHandler
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

    record_property("fault", "Prefect server lost: later calls not retried")
    handler = APILogHandler()
    logging.getLogger("prefect.flow_runs").addHandler(handler)
    before = PREFECT_CLIENT_MAX_RETRIES.value()
    try:
        orchestration.mark_lost("a test", ConnectionRefusedError())
        record = logging.LogRecord("prefect.flow_runs", logging.INFO, __file__, 1, "x", None, None)
        assert orchestration.lost() and PREFECT_CLIENT_MAX_RETRIES.value() == 0
        assert not handler.filter(record) and EventsWorker._client_override is not None
        orchestration.reset()
        assert not orchestration.lost() and PREFECT_CLIENT_MAX_RETRIES.value() == before
        assert handler.filter(record) and EventsWorker._client_override is None
    finally:
        orchestration.reset()
        logging.getLogger("prefect.flow_runs").removeHandler(handler)
