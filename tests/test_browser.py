"""The UIs, rendered by headless Chromium (Debian's package).

- The session's `baton run configs/tiny.yaml` against the stack (tests/default_run.py): the
  Prefect flow-run page is named `tiny-<run id>` and lists the stage subflows; the run summary artifact carries the
  lineage diagram; the MLflow model version page shows its gate report. These tests save the screenshots in docs/ that
  the docs' concepts page shows.
- The nightly retraining: the Prefect flow-run page shows its stage subflows and artifacts; MLflow shows the stage runs
  of the experiment and the registry's `champion` alias.

Both UIs ask who you are (the stack's credentials, in stack.env): Prefect's on its login page, where the tests type the
auth string as a user pastes it; MLflow's by HTTP basic auth, whose credentials the tests send with every request, as
a browser does once its prompt is answered.
"""
from __future__ import annotations

import base64
import re
import os
import tempfile
import time
from pathlib import Path

import pytest

from browser import Chromium

pytestmark = pytest.mark.ops

REPO = Path(__file__).resolve().parent.parent
# The docs' screenshots are refreshed only when asked (BATON_SCREENSHOTS=1); otherwise they go to a scratch folder
# so a test run leaves the checkout as it was.
DOCS = REPO / "docs" if os.environ.get("BATON_SCREENSHOTS") == "1" else Path(tempfile.mkdtemp(prefix="baton-shots-"))
SHOT = {"width": 1280, "height": 800}
SHOT_MAX_BYTES = 400_000


@pytest.fixture(scope="module")
def tiny_run(ops_stack, default_run) -> dict:
    """The session's `baton run configs/tiny.yaml` against the stack (tests/default_run.py); its flow run."""
    assert default_run.rc == 0, default_run.failure()
    return {"summary": default_run.summary, "stages": default_run.stages,
            "flow_run": ops_stack.flow_run(default_run.summary["prefect_flow_run_id"])}


def prefect_login(b: Chromium, ops_stack) -> None:
    """The Prefect UI's login page, answered with the auth string from stack.env; the UI keeps it for the origin."""
    b.goto(f"{ops_stack.prefect_url}/login")
    b.type_into("input[type=password]", ops_stack.env["PREFECT_API_AUTH_STRING"])
    b.evaluate("document.querySelector('form').requestSubmit()")
    b.wait_until("location.pathname !== '/login' && !!localStorage.getItem('prefect-password')")


def mlflow_login(b: Chromium, ops_stack) -> None:
    env = ops_stack.env
    token = base64.b64encode(f"{env['MLFLOW_TRACKING_USERNAME']}:{env['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()
    b.send_headers({"Authorization": f"Basic {token}"})


def test_prefect_flow_run_page_is_named_after_the_run_and_lists_the_stages(ops_stack, tiny_run):
    fr, run_id = tiny_run["flow_run"], tiny_run["summary"]["run_id"]
    assert fr["name"] == f"tiny-{run_id}"
    with Chromium(**SHOT) as b:
        prefect_login(b, ops_stack)
        b.goto(f"{ops_stack.prefect_url}/runs/flow-run/{fr['id']}")
        b.wait_for([f"tiny-{run_id}", "baton-pipeline", "Completed"])
        assert b.click_text("Subflow Runs")
        b.scroll_to_bottom()
        b.wait_for(["stage-data", "stage-pretrain", "stage-convert", "convert-megatron-to-hf"])
        b.scroll_to_top()
        time.sleep(2)  # the run graph (a canvas) draws its subflow boxes
        assert b.screenshot(DOCS / "prefect-flow-run.png") < SHOT_MAX_BYTES


def test_prefect_summary_artifact_carries_the_lineage_diagram(ops_stack, tiny_run):
    fr = tiny_run["flow_run"]
    (art,) = ops_stack.api("POST", "/artifacts/filter", {"artifacts": {
        "flow_run_id": {"any_": [fr["id"]]}, "key": {"any_": ["baton-run-summary"]}}})
    assert "```mermaid" in art["data"] and "flowchart LR" in art["data"]
    with Chromium(**SHOT) as b:
        prefect_login(b, ops_stack)
        b.goto(f"{ops_stack.prefect_url}/artifacts/artifact/{art['id']}")
        text = b.wait_for(["Lineage", "flowchart LR", "-->"])
        # every step of the chain is a box of the diagram, from the data to the HF checkpoint
        diagram = b.evaluate("[...document.querySelectorAll('pre, code, .mermaid')].map(e => e.textContent)"
                             ".find(t => t.includes('flowchart LR')) || ''")
        for step in ("data", "pretrain", "convert-megatron-to-hf"):
            assert f"<b>{step}</b>" in diagram, (step, diagram or text[:3000])
        assert diagram.count("-->") >= 2, diagram


def _close_mlflow_assistant(b: Chromium) -> None:
    """A new browser profile opens MLflow's chat assistant beside every page; a reader of the screenshot wants the page."""
    close = 'button[data-component-id="mlflow.assistant.chat_panel.close"]'
    deadline = time.time() + 20
    while time.time() < deadline and not b.click_all(close):
        time.sleep(0.5)
    time.sleep(1)


def test_mlflow_run_and_model_version_pages_show_the_training_and_the_gate_report(ops_stack, tiny_run):
    stages = tiny_run["stages"]
    pre, conv = stages["pretrain"], stages["convert-megatron-to-hf"]
    reg = conv["registered"]
    exp = ops_stack.mlflow().get_experiment_by_name("baton").experiment_id
    with Chromium(**SHOT) as b:
        mlflow_login(b, ops_stack)
        run_page = f"{ops_stack.mlflow_url}/#/experiments/{exp}/runs/{pre['mlflow_run_id']}"
        b.goto(run_page)
        b.wait_for(["pretrain", "Overview", "Finished", "Registered models"])
        b.click_text("Model training")  # the sidebar's workflow switch (a browser setting, not the experiment's)
        b.goto(run_page)
        b.wait_for(["pretrain", "Finished", "Registered models", "Model metrics (", "heldout_ppl", "loss"])
        _close_mlflow_assistant(b)
        time.sleep(2)  # the metric table and parameter list settle
        assert b.screenshot(DOCS / "mlflow-run.png") < SHOT_MAX_BYTES

        b.goto(f"{ops_stack.mlflow_url}/#/models/{reg['name']}/versions/{reg['version']}")
        text = b.wait_for([f"Version {reg['version']}", "Gate", "L2.logits_parity", "L3.generation",
                           "Data digest"])
        assert "gate passed" in text, text[:3000]
        _close_mlflow_assistant(b)
        assert "FAIL |" not in text
        time.sleep(1)
        assert b.screenshot(DOCS / "mlflow-model-version.png") < SHOT_MAX_BYTES


def test_prefect_flow_run_page_shows_the_stages(ops_stack, retrain_outcomes):
    fr = retrain_outcomes["v2"]["flow_run"]
    with Chromium() as b:
        prefect_login(b, ops_stack)
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
        mlflow_login(b, ops_stack)
        b.goto(f"{ops_stack.mlflow_url}/#/experiments/{exp}/runs")
        b.wait_for(["Run Name", "retrain-decision-"])
        assert b.click_all('button[data-component-id*="runnamecellrenderer"]')  # unfold the stage runs of each parent
        b.wait_for(["data", "finetune", "convert-zero-to-hf", "serve"])
        b.goto(f"{ops_stack.mlflow_url}/#/models/baton-tiny")
        text = b.wait_for(["@ champion", f"Version {champion}"])
        block = re.search(rf"Version {champion}\n(.*?)(?=\nVersion \d|\Z)", text, re.S).group(1)
        assert "@ champion" in block, block  # the alias sits on the version retraining promoted
