"""A rank killed mid-run, then the run cancelled the way users do: `prefect flow-run cancel ID` (what the UI's Cancel
button sends) against the real local stack while the fine-tuning engine (DeepSpeed launcher + 2 ranks) trains. The
killed rank is retried from its checkpoint; after the cancel nothing of the engine is left, the step is free, every record says cancelled, and the next run of the same config takes the step over
and resumes from the cancelled run's last checkpoint."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import pytest

from flows.config import load
from flows.runs import Index, StepLock
from tasks import orchestration
from ops_stack import REPO, runs_tagged

pytestmark = [pytest.mark.ops, pytest.mark.reliability, pytest.mark.long]  # ~5 min: three 2-rank launches through the stack

FINETUNE = {"steps": 60, "nproc_per_node": 2, "checkpoint_every": 20, "keep_checkpoints": 1, "warmup_steps": 1,
            "timeout_s": 900}
GONE_WITHIN_S = 60  # Prefect's runner SIGKILLs the flow's process 30 s after its SIGTERM; the engine goes before


def _pipeline_config() -> dict:
    cfg = load(REPO / "configs" / "tiny.yaml", stages=["data", "finetune"]).model_dump(mode="json")
    cfg.update(name="cancel")
    cfg["finetune"].update(FINETUNE)
    return cfg


def _flow_process(flow_run_id: str) -> psutil.Process:
    """The process the worker started for this flow run (`python -m prefect.engine`)."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id and "prefect.engine" in " ".join(p.cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    raise AssertionError(f"no process runs flow run {flow_run_id}")


def _engine_processes(home: Path) -> list[psutil.Process]:
    """Every process of a fine-tuning engine started from this BATON_HOME (launcher, torch launcher, ranks)."""
    found = []
    for p in psutil.process_iter():
        try:
            cmd = " ".join(p.cmdline())
            if "tasks/finetune/worker.py" in cmd and p.environ().get("BATON_HOME") == str(home):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait_for(pattern: str, path: Path, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and (m := re.search(pattern, path.read_text(errors="replace"))):
            return m
        time.sleep(1)
    raise AssertionError(f"{pattern!r} not in {path} after {timeout}s")


def _step_record(home: Path, run_id: str, label: str) -> dict:
    for f in (home / "index").glob("*.json"):
        rec = json.loads(f.read_text())
        if rec.get("run_id") == run_id and (rec.get("entry") or {}).get("label") == label:
            return rec
    raise AssertionError(f"no index record of {label} in run {run_id}")


def _mlflow_runs(stack, run_id: str) -> dict[str, object]:
    """The run's MLflow runs by stage ('pipeline' for the parent)."""
    found = runs_tagged(stack.mlflow(), "baton.run_id", run_id)
    return {r.data.tags.get("baton.stage", "pipeline"): r for r in found}


def _kill_a_rank_and_see_it_retried(ops_stack, fr_id: str, engine_log: Path) -> None:
    """A rank SIGKILLed mid-run (what the OOM killer or a preemption does) is retried from the last checkpoint."""
    rank1 = [p for p in _engine_processes(ops_stack.home) if "--local_rank=1" in " ".join(p.cmdline())]
    assert len(rank1) == 1, [p.cmdline() for p in _engine_processes(ops_stack.home)]
    rank1[0].kill()
    deadline = time.time() + 420
    while len(starts := re.findall(r"starting at step (\d+)", engine_log.read_text())) < 2:
        assert time.time() < deadline, f"no retry in {engine_log}"
        time.sleep(1)
    assert int(starts[-1]) >= FINETUNE["checkpoint_every"], starts  # resumed from the checkpoint, not from step 0
    assert "infrastructure failure" in ops_stack.logs_all(fr_id, min_level=30)
    deadline = time.time() + 120
    while len(_engine_processes(ops_stack.home)) < 3:  # the launcher and both ranks of the retry
        assert time.time() < deadline, "the retry's engine did not start"
        time.sleep(1)


def test_killed_rank_is_retried_then_prefect_cancel_stops_the_engine_and_closes_every_record(
        ops_stack, initial_champion, record_property):
    record_property("fault", "rank SIGKILLed, then prefect flow-run cancel mid-training")
    home, cfg = ops_stack.home, _pipeline_config()
    fr_id = ops_stack.run_deployment("baton-pipeline/tiny", {"config": cfg, "from_ref": initial_champion["path"],
                                                             "run_id": "cancel-1"}, watch=False)
    engine_log = home / "runs" / "cancel-1" / "01-finetune" / "engine.log"
    _wait_for(r'"kind": "checkpoint"', engine_log, timeout=600)
    _kill_a_rank_and_see_it_retried(ops_stack, fr_id, engine_log)
    flow_proc = _flow_process(fr_id)
    # a deployment run's Prefect client retries are bounded as `baton run`'s are (the stack's worker gives them)
    assert flow_proc.environ().get("PREFECT_CLIENT_MAX_RETRIES") == orchestration.CLIENT_DEFAULTS[
        "PREFECT_CLIENT_MAX_RETRIES"], flow_proc.environ().get("PREFECT_CLIENT_MAX_RETRIES")
    tree = [flow_proc] + flow_proc.children(recursive=True)
    engine = _engine_processes(home)
    assert len(engine) >= 3 and {p.pid for p in engine} <= {p.pid for p in tree}, [p.cmdline() for p in engine]

    t0 = time.time()
    ops_stack.prefect("flow-run", "cancel", fr_id)
    _, alive = psutil.wait_procs(tree, timeout=GONE_WITHIN_S)
    gone_s = time.time() - t0
    assert not alive, f"outlived the cancellation by {GONE_WITHIN_S}s: {[p.cmdline() for p in alive]}"
    assert not _engine_processes(home)
    fr = ops_stack.wait_state(fr_id, {"CANCELLED", "CRASHED", "FAILED", "COMPLETED"}, timeout=120)
    assert fr["state_type"] == "CANCELLED", fr["state"]
    subs = ops_stack.api("POST", "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [fr_id]}}})
    assert {s["name"]: s["state_type"] for s in subs} == {"data": "COMPLETED", "finetune": "CANCELLED"}, subs

    rec = _step_record(home, "cancel-1", "finetune")
    assert rec["status"] == "cancelled" and rec["entry"]["error"].startswith("cancelled (SIGTERM"), rec
    assert StepLock(rec["fingerprint"], root=home).holder() is None
    owners = [json.loads(f.read_text()) for f in (home / "locks").glob("*.owner.json")]
    assert not [o for o in owners if o.get("run_id") == "cancel-1"], owners
    summary = json.loads((home / "runs" / "cancel-1" / "summary.json").read_text())
    assert summary["status"] == "cancelled"
    statuses = {s["label"]: s["status"] for s in summary["stages"]}
    assert statuses["finetune"] == "cancelled" and statuses["data"] in ("completed", "cached"), statuses
    mlruns = _mlflow_runs(ops_stack, "cancel-1")
    assert mlruns["pipeline"].info.status == "KILLED" and mlruns["finetune"].info.status == "KILLED"
    stopped_at = max(int(s) for s in re.findall(r'"kind": "checkpoint", "step": (\d+)', engine_log.read_text()))
    print(f"cancelled at checkpoint step {stopped_at}: {len(tree)} processes gone {gone_s:.1f}s after "
          "`prefect flow-run cancel`")

    # the same config again: the step is taken over, resuming from the cancelled run's last checkpoint
    t1 = time.time()
    fr2 = ops_stack.run_deployment("baton-pipeline/tiny", {"config": cfg, "from_ref": initial_champion["path"],
                                                           "run_id": "cancel-2"}, timeout=900)
    assert ops_stack.flow_run(fr2)["state_type"] == "COMPLETED", ops_stack.last_output[-3000:]
    starts = [int(s) for s in re.findall(r"starting at step (\d+)", engine_log.read_text())]
    assert starts[0] == 0 and len(starts) == 3 and starts[-1] == stopped_at, starts  # first try, retry, this run
    summary2 = json.loads((home / "runs" / "cancel-2" / "summary.json").read_text())
    assert summary2["status"] == "completed" and summary2["stages"][-1]["status"] == "completed"
    assert _step_record(home, "cancel-2", "finetune")["status"] == "completed"
    assert _mlflow_runs(ops_stack, "cancel-2")["finetune"].info.status == "FINISHED"
    print(f"second run took the step over from step {stopped_at} and completed in {time.time() - t1:.0f}s")
