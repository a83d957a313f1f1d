"""The UIs, rendered by headless Chromium (Debian's package): the Prefect flow-run page of a retraining run shows its
stage subflows and artifacts; MLflow shows the stage runs of the experiment and the registry's `champion` alias."""
from __future__ import annotations

import re

from browser import Chromium


def test_prefect_flow_run_page_shows_the_stages(ops_stack, retrain_outcomes):
    fr = retrain_outcomes["v2"]["flow_run"]
    with Chromium() as b:
        b.goto(f"{ops_stack.prefect_url}/runs/flow-run/{fr['id']}")
        b.wait_for([fr["name"], "baton-retrain", "nightly", "Completed", "retrain decision: promoted"])
        assert b.click_text("Subflow Runs")
        b.wait_for(["stage-data", "stage-finetune", "stage-convert", "stage-serve"])
        assert b.click_text("Artifacts")
        b.wait_for(["retrain-decision", "baton-run-summary"])
        # the run summary of the fine-tuning pipeline: its stage table and its loss plot, rendered
        arts = ops_stack.api("POST", "/artifacts/filter", {"artifacts": {
            "flow_run_id": {"any_": [fr["id"]]}, "key": {"any_": ["baton-run-summary"]}}})
        summary = next(a for a in arts if "data:image/png" in a["data"])
        b.goto(f"{ops_stack.prefect_url}/artifacts/artifact/{summary['id']}")
        b.wait_for(["finetune", "convert-zero-to-hf", "completed"])
        images = b.evaluate("[...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/png'))"
                            ".map(i => i.naturalWidth)")
        assert images and all(w > 100 for w in images), images
        assert b.evaluate("document.querySelectorAll('table').length") >= 1


def test_mlflow_pages_show_the_stage_runs_and_the_champion(ops_stack, retrain_outcomes):
    c = ops_stack.mlflow()
    exp = c.get_experiment_by_name("baton").experiment_id
    champion = retrain_outcomes["v3"]["champion"]
    with Chromium() as b:
        b.goto(f"{ops_stack.mlflow_url}/#/experiments/{exp}/runs")
        b.wait_for(["Run Name", "retrain-decision-"])
        assert b.click_all('button[data-component-id*="runnamecellrenderer"]')  # unfold the stage runs of each parent
        b.wait_for(["data", "finetune", "convert-zero-to-hf", "serve"])
        b.goto(f"{ops_stack.mlflow_url}/#/models/baton-tiny")
        text = b.wait_for(["@ champion", f"Version {champion}"])
        block = re.search(rf"Version {champion}\n(.*?)(?=\nVersion \d|\Z)", text, re.S).group(1)
        assert "@ champion" in block, block  # the alias sits on the version retraining promoted
