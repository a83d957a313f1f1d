"""Operations on the real local stack (`make up`: Prefect server + process worker + deployments, MLflow server):
deployment runs through the worker, typed deployment parameters, heartbeats and the zombie automation, retraining
that promotes only better models. (A killed rank retried, then the run cancelled: tests/test_ops_cancel.py.)"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from ops_stack import REPO, runs_tagged as _runs_tagged


def test_pipeline_deployment_runs_through_the_worker(ops_stack):
    t0 = time.time()
    # use_cache off: other tests on this stack (the browser's tiny run) may have completed the same data step
    fr_id = ops_stack.run_deployment("baton-pipeline/tiny", {"config": {"name": "tiny", "stages": ["data"]},
                                                             "use_cache": False})
    fr = ops_stack.flow_run(fr_id)
    assert fr["state_type"] == "COMPLETED", (f"{fr['state_type']}: {fr['state'].get('message')}\n"
                                             f"{ops_stack.logs_all(fr_id)[-4000:]}\n{ops_stack.last_output[-2000:]}")
    assert fr["work_pool_name"] == "baton-local" and fr["deployment_id"]
    print(f"deployment run: {time.time() - t0:.1f}s (stack up: {ops_stack.up_seconds:.1f}s)")

    c = ops_stack.mlflow()
    (parent,) = _runs_tagged(c, "prefect.flow_run_id", fr_id)
    assert "mlflow.parentRunId" not in parent.data.tags and parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_url"] == f"{ops_stack.prefect_url}/runs/flow-run/{fr_id}"
    children = _runs_tagged(c, "prefect.pipeline_flow_run_id", fr_id)
    assert {r.data.tags["baton.stage"] for r in children} == {"data"}
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        sub = ops_stack.flow_run(child.data.tags["prefect.flow_run_id"])  # the stage's subflow run
        assert sub["parent_task_run_id"] and sub["state_type"] == "COMPLETED"
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:/")  # the server's artifact root

    arts = ops_stack.api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [fr_id]}}})
    summary = next(a for a in arts if a["key"] == "baton-run-summary")
    assert summary["type"] == "markdown" and "| data | completed |" in summary["data"]

    beats = ops_stack.api("POST", "/events/filter", {"filter": {
        "event": {"name": ["prefect.flow-run.heartbeat"]}, "resource": {"id": [f"prefect.flow-run.{fr_id}"]}}})
    assert beats["events"], "the flow run sent no heartbeat"


@pytest.mark.ops
def test_the_prefect_cli_in_a_fresh_shell_talks_to_the_stack(ops_stack):
    """The README's `prefect deployment ls` as typed in a new shell after `make up`: no PREFECT_API_URL set, the
    `baton` profile that `make up` made active points the CLI at the stack (not at a temporary server)."""
    env = dict(ops_stack.make_env(), COLUMNS="200")
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "prefect"), "deployment", "ls"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "baton-finetune/tiny" in proc.stdout and "baton-retrain/nightly" in proc.stdout, proc.stdout
    assert "temporary server" not in proc.stdout + proc.stderr


def test_zombie_automation_is_installed(ops_stack):
    autos = ops_stack.api("POST", "/automations/filter", {})
    (zombie,) = [a for a in autos if a["name"] == "Crash zombie flows"]
    trig = zombie["trigger"]
    assert trig["posture"] == "Proactive" and trig["after"] == ["prefect.flow-run.heartbeat"]
    assert "prefect.flow-run.Completed" in trig["expect"] and trig["within"] >= 60
    assert zombie["actions"][0]["type"] == "change-flow-run-state" and zombie["actions"][0]["state"] == "CRASHED"


def test_every_deployment_has_a_typed_form(ops_stack):
    deps = {f"{d['flow_name']}/{d['name']}": d for d in _deployments(ops_stack)}
    assert set(deps) >= {"baton-pipeline/tiny", "baton-data/tiny", "baton-pretrain/tiny", "baton-rlhf/tiny",
                         "baton-finetune/tiny", "baton-export/tiny", "baton-serve/tiny", "baton-convert/tiny",
                         "baton-retrain/nightly"}
    for name, d in deps.items():
        assert d["enforce_parameter_schema"], name
        assert d["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    ft = deps["baton-finetune/tiny"]["parameter_openapi_schema"]
    zero = ft["definitions"]["ZeroConfig"]["properties"]
    assert zero["stage"]["type"] == "integer" and ft["definitions"]["FinetuneConfig"]["properties"]["lr"]["type"] == "number"
    assert "PipelineConfig" in deps["baton-pipeline/tiny"]["parameter_openapi_schema"]["definitions"]
    (sched,) = deps["baton-retrain/nightly"]["schedules"]
    assert sched["schedule"]["cron"] == "0 3 * * *"  # (the test stack pauses it)
    assert deps["baton-retrain/nightly"]["global_concurrency_limit"]["limit"] == 1
    # the server validates a run's parameters against the schema: nothing is created for a bad value
    bad = ops_stack.prefect("deployment", "run", "baton-finetune/tiny", "--param", 'finetune={"steps": "many"}',
                            check=False)
    assert bad.returncode != 0 and "steps" in bad.stdout + bad.stderr


def _deployments(stack) -> list[dict]:
    deps = stack.api("POST", "/deployments/filter", {})
    flows = {f["id"]: f["name"] for f in stack.api("POST", "/flows/filter", {})}
    return [dict(d, flow_name=flows[d["flow_id"]]) for d in deps]


# ---- retraining ------------------------------------------------------------------------------------------------------
def _served_models(serving: dict) -> list[str]:
    import urllib.request

    key = Path(serving["api_key_file"]).read_text().strip()
    req = urllib.request.Request(serving["server"]["base_url"] + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [m["id"] for m in json.loads(r.read())["data"]]


# Which way each held-out metric gets better, written here rather than read from tasks/gates.py.
BETTER = {"heldout_exact_match": 1, "heldout_loss": -1}


def _finetune_eval(ops_stack, decision: dict) -> dict:
    """The fine-tuning stage's own eval record, from its run's summary.json (not the decision's copy of it)."""
    summaries = [json.loads(path.read_text()) for run_id in decision["runs"] if run_id
                 for path in [ops_stack.home / "runs" / run_id / "summary.json"] if path.exists()]
    (entry,) = [s for summary in summaries for s in summary.get("stages", []) if s["name"] == "finetune"]
    return entry["eval"]


def _scores_are_the_finetune_measurements(ops_stack, d: dict) -> None:
    ev = _finetune_eval(ops_stack, d)
    assert (d["metric"], d["champion_score"], d["candidate_score"]) == (ev["metric"], ev["before"], ev["after"])
    assert d["metric"] in BETTER and all(isinstance(d[k], (int, float)) for k in ("champion_score", "candidate_score"))


def test_retrain_promotes_better_data(ops_stack, retrain_outcomes):
    r = retrain_outcomes["v2"]
    d = r["decision"]
    assert r["flow_run"]["state_type"] == "COMPLETED"
    assert d["decision"] == "promoted", d
    _scores_are_the_finetune_measurements(ops_stack, d)
    assert BETTER[d["metric"]] * (d["candidate_score"] - d["champion_score"]) > 0  # clean data made it better
    assert r["champion"] == d["candidate_version"] != retrain_outcomes["initial"]
    mv = ops_stack.mlflow().get_model_version("baton-tiny", r["champion"])
    assert mv.tags["data_digest"] == d["data_digest"] and mv.tags["baton.retrain.decision"] == "promoted"
    # the served model followed: the server started for the new champion answers with its version
    assert r["serving"]["version"] == r["champion"]
    assert _served_models(r["serving"]) == [f"baton-tiny:{r['champion']}"]


def test_retrain_keeps_the_champion_on_worse_data(ops_stack, retrain_outcomes):
    before, r = retrain_outcomes["v2"], retrain_outcomes["v3"]
    d = r["decision"]
    assert r["flow_run"]["state_type"] == "COMPLETED"
    assert d["decision"] == "kept", d
    assert d["champion_version"] == before["champion"] == r["champion"]  # alias unchanged
    assert d["data_digest"] != before["decision"]["data_digest"]
    _scores_are_the_finetune_measurements(ops_stack, d)
    # serving untouched: the same server process still serves the same version
    assert r["serving"]["server"]["pid"] == before["serving"]["server"]["pid"]
    assert psutil.pid_exists(r["serving"]["server"]["pid"])
    assert _served_models(r["serving"]) == [f"baton-tiny:{before['champion']}"]
