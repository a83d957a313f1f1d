"""The docs' deployment command, run exactly as written (its text is read from docs/operations.md at test time, so
the test breaks when the docs drift) in a fresh shell after `make up`: no PREFECT_API_URL, only the `baton` Prefect
profile `make up` made active. Its champion is the cheapest one: a checkpoint registered as `baton-tiny@champion`."""
from __future__ import annotations

import re
import subprocess

import pytest

from ops_stack import REPO, runs_tagged
from tasks import events

pytestmark = pytest.mark.ops

FINETUNE_COMMAND = re.compile(r"`([^`]*prefect deployment run 'baton-finetune/tiny'[^`]*)`")


def readme_command() -> str:
    (command,) = FINETUNE_COMMAND.findall((REPO / "docs" / "operations.md").read_text())
    return command


def test_readme_finetune_deployment_command_runs_as_written(ops_stack, initial_champion):
    command = readme_command()
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=ops_stack.make_env(), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "temporary server" not in out, out[-3000:]
    fr_id = re.search(r"UUID:\s*(\S+)", out).group(1)
    fr = ops_stack.wait_state(fr_id, {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}, timeout=1500)
    assert fr["state_type"] == "COMPLETED", ops_stack.logs_all(fr_id, min_level=30)[-4000:]

    # what the docs say it does: fine-tunes baton-tiny@champion for the given steps and registers the result
    # (converted back to HF) as baton-tiny@candidate
    c = ops_stack.mlflow()
    children = runs_tagged(c, "prefect.pipeline_flow_run_id", fr_id)
    (run,) = [r for r in children if r.data.tags["baton.stage"] == "finetune"]
    steps = int(re.search(r'"steps": (\d+)', command).group(1))
    assert run.info.status == "FINISHED" and run.data.params["stage.steps"] == str(steps)
    assert max(m.step for m in c.get_metric_history(run.info.run_id, "train/loss")) == steps
    candidate = c.get_model_version_by_alias("baton-tiny", "candidate")
    assert candidate.run_id in {r.info.run_id for r in children}
    assert candidate.tags["format"] == "hf-safetensors" and candidate.tags["baton.run_id"] == run.data.tags["baton.run_id"]
    # every metric its MLflow runs got follows the one scheme (MLflow's own system/ metrics aside)
    names = {k for r in children for k in c.get_run(r.info.run_id).data.metrics}
    assert {"train/loss", "train/lr", "perf/step_time_s", "perf/tokens_per_s", "perf/peak_mem_mib", "summary/wall_s",
            "summary/peak_mem_mib", "summary/predicted_peak_mem_mib"} <= names, names
    assert not [(n, events.name_problem(n)) for n in names if not n.startswith("system/") and events.name_problem(n)]
    summary = ops_stack.api("POST", "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [fr_id]}}})
    assert any(a["key"] == "baton-run-summary" and "| finetune | completed |" in a["data"] for a in summary)
