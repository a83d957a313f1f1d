"""`baton run configs/tiny.yaml --stages data`: datasets, tokenizer, manifests, summary.json, MLflow runs."""
import json

from mlflow import MlflowClient

from conftest import TINY, baton
from conversions import verify


def test_data_stage_end_to_end(baton_home):
    r = baton("run", str(TINY), "--stages", "data", home=baton_home, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = r.stdout.strip().splitlines()[-1]
    summary = json.loads((baton_home / "runs" / run_dir.rsplit("/", 1)[-1] / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["prefect_flow_run_id"]
    (stage,) = summary["stages"]
    assert stage["name"] == "data" and stage["status"] == "completed" and stage["gate"]["passed"]
    out = stage["output"]
    assert out.startswith(run_dir)
    for f in ("tokenizer/tokenizer.json", "tokenizer/chat_template.jinja", "pretrain/train.jsonl",
              "preference/heldout.jsonl", "sft/train.jsonl", "baton_manifest.json"):
        assert (__import__("pathlib").Path(out) / f).exists(), f
    assert verify.report(verify.integrity(__import__("pathlib").Path(out)))["passed"]
    row = json.loads(open(f"{out}/sft/train.jsonl").readline())
    assert set(row) == {"messages"} and [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert json.loads(row["messages"][-1]["content"])["category"]

    c = MlflowClient(tracking_uri=f"sqlite:///{baton_home}/mlflow.db")
    parent = c.get_run(summary["mlflow_run_id"])
    assert parent.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    child = c.get_run(stage["mlflow_run_id"])
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    names = {d.dataset.name for d in child.inputs.dataset_inputs}
    assert {"pretrain-train", "preference-heldout", "sft-train", "sft-heldout"} <= names
    assert child.data.params["stage.pretrain_docs"] == "3000"

    # the Prefect run carries the summary artifact (markdown table of every stage)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as pc:
        arts = pc.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[summary["prefect_flow_run_id"]])))
    md = [a for a in arts if a.key == "baton-run-summary"]
    assert md and "| data | completed |" in md[0].data

    # unchanged config and code: the stage is not re-run
    r2 = baton("run", str(TINY), "--stages", "data", home=baton_home, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    s2 = json.loads((baton_home / "runs" / r2.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1] / "summary.json").read_text())
    assert s2["stages"][0]["status"] == "cached" and s2["stages"][0]["output"] == out


def test_midchain_stage_without_input_fails_before_launch(baton_home):
    r = baton("run", str(TINY), "--stages", "rlhf", home=baton_home, timeout=120)
    assert r.returncode == 2
    assert "needs an input checkpoint" in r.stderr and "--from" in r.stderr
    assert not (baton_home / "runs").exists()
