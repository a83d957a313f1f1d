"""A promoted server baton leaves running on its own is supervised, on vLLM with the tiny model (issue 12, items 6 and 2):
retrain's own switch serves the candidate (a keep_alive serve stage on a side port, smoke-tested), moves the champion
and publishes serving.json; the engine SIGKILLed is restarted and answers again; killed once more than
`serve.restarts` allows, the supervisor gives up, serving.json says down and the champion rolls back; the next retrain
run's reconciliation serves the champion again; stop_serving leaves no process and no /dev/shm segment behind."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from conftest import make_hf_checkpoint
from conversions import hf, manifest as mf
from flows import retrain
from tasks import tracking
from tasks.serve import supervisor
from tasks.serve.server import LEFTOVER_PATTERNS, _in_use, _mapped_shm, shm_entries

# three vLLM starts (~2 min): make test-long
pytestmark = [pytest.mark.serve, pytest.mark.reliability, pytest.mark.long, pytest.mark.timeout(900)]
NAME = "supervised-vllm"


def register(c, path: Path) -> str:
    digest = mf.digest_of(mf.read(path))
    return str(tracking.register_checkpoint(c, NAME, path, None, tags={"manifest_digest": digest}, alias=None))


def served_models(state: dict) -> list[str]:
    key = Path(state["api_key_file"]).read_text().strip()
    req = urllib.request.Request(state["server"]["base_url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [m["id"] for m in json.load(r)["data"]]


def engine_state(state: dict) -> dict:
    return supervisor.read_json(state["server"]["state"]) or {}


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def group(pgid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def in_flow(fn, *args):
    """Run one retrain step inside a flow run, as the retrain flow does (the pipeline body logs to its run)."""
    from prefect import flow

    def step():
        return fn(*args)

    return flow(name="retrain-step", log_prints=True)(step)()


def unused_leftovers(before: set[str]) -> list[str]:
    import fnmatch

    new = [n for n in shm_entries() - before if any(fnmatch.fnmatch(n, p) for p in LEFTOVER_PATTERNS)]
    used, inodes = _mapped_shm()
    return sorted(n for n in new if not _in_use(n, used, inodes))


def test_promoted_vllm_server_supervised_rolled_back_and_reconciled(tmp_path, baton_home, hf_checkpoint, data_dir,
                                                                    tiny_config, record_property):
    record_property("fault", "promoted vLLM engine SIGKILLed")
    shm_before = shm_entries()
    newer = make_hf_checkpoint(tmp_path / "v2", tiny_config.model.model_dump(), data_dir / "tokenizer", seed=1)
    mf.write(newer, mf.build(newer, format="hf-safetensors", stage="external", dtype="float32",
                             parameter_count=hf.parameter_count(newer), architecture=tiny_config.model.model_dump()))
    c = tracking.client()
    v1, v2 = register(c, hf_checkpoint), register(c, newer)
    tracking.promote_champion(c, NAME, v1)
    base = tiny_config.model_copy(update={"tracking": tiny_config.tracking.model_copy(
        update={"registered_model": NAME})})
    serve = tiny_config.serve.model_copy(update={
        "engine": "vllm", "restarts": 1, "health_timeout_s": 300,
        "lm_eval": tiny_config.serve.lm_eval.model_copy(update={"enabled": False}),
        "smoke": tiny_config.serve.smoke.model_copy(update={"json_requests": 2, "parity_prompts": 1})})
    try:
        # retrain's switch: candidate served and smoke-tested on a side port, champion moved by CAS, serving switched
        candidate = in_flow(retrain.serve_candidate, base, serve, str(newer), v2)
        assert "error" not in candidate, candidate
        tracking.promote_champion(c, NAME, v2, expected=v1)
        state = retrain.switch_serving(NAME, candidate)
        assert served_models(state) == [f"{NAME}:{v2}"]

        first = engine_state(state)["engine_pid"]
        t0 = time.time()
        os.killpg(first, signal.SIGKILL)  # an OOM kill, say
        wait_for(lambda: engine_state(state).get("restarts_used") == 1 and engine_state(state)["status"] == "serving",
                 300, "the restarted engine")
        record_property("restart_s", round(time.time() - t0, 1))
        second = engine_state(state)["engine_pid"]
        assert second != first and not group(first)
        assert served_models(state) == [f"{NAME}:{v2}"]
        assert retrain.serving()["server"]["engine_pid"] == second

        os.killpg(second, signal.SIGKILL)  # once more than serve.restarts: 1
        wait_for(lambda: not supervisor.running(state["server"]["pid"], None), 120, "the supervisor to give up")
        assert engine_state(state)["status"] == "down" and retrain.serving()["status"] == "down"
        assert str(c.get_model_version_by_alias(NAME, tracking.CHAMPION).version) == v1, "champion not rolled back"

        # the next retrain run reconciles: the champion (v1 again) is served again
        did = in_flow(retrain.reconcile_serving, base, serve, retrain.champion(c, NAME), NAME)
        assert did and f"serving champion version {v1} again" in did, did
        state = retrain.serving()
        assert str(state["version"]) == v1 and served_models(state) == [f"{NAME}:{v1}"]
        engine = engine_state(state)["engine_pid"]

        retrain.stop_serving()
        assert not supervisor.running(state["server"]["pid"], None) and not group(engine)
        assert retrain.serving() is None
        assert unused_leftovers(shm_before) == []
    finally:
        retrain.stop_serving()
