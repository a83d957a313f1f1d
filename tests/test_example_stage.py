"""docs/architecture.md's "How to add a stage", proven: the example stage of tests/example_stage/ (a package outside
baton, registered only by naming it in BATON_STAGES) runs inside `baton run` between two real stages (data, pretrain),
shows in `baton config`, the summary and MLflow, and is reused or re-run by the cache rules (its code is in its key).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, baton

TINY = REPO / "configs" / "tiny.yaml"
# data → example → pretrain at the smallest size that still trains (the pretrain step only proves the chain goes on)
SETTINGS = ["stages=[data,example,pretrain]", "data.pretrain_docs=200", "data.preference_pairs=40",
            "data.sft_examples=60", "pretrain.steps=2", "pretrain.checkpoint_every=2", "pretrain.eval_interval=2",
            "pretrain.warmup_steps=0", "example.min_rows=10"]


@pytest.fixture
def plugin(tmp_path) -> tuple[Path, dict]:
    """The example package copied outside the checkout (the test edits it), and the environment that registers it."""
    folder = tmp_path / "plugins"
    shutil.copytree(REPO / "tests" / "example_stage", folder / "example_stage")
    return folder / "example_stage", {"BATON_STAGES": "example_stage", "PYTHONPATH": f"{folder}:{REPO}"}


def _run(home: Path, env: dict) -> dict:
    r = baton("run", str(TINY), *(a for s in SETTINGS for a in ("--set", s)), home=home, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    return {e["label"]: e for e in summary["stages"]}


def _planned(home: Path, env: dict) -> dict[str, str]:
    """`baton config`'s planned steps: label -> what would happen (`to run: new`, `cached`, ...)."""
    shown = baton("config", str(TINY), *(a for s in SETTINGS for a in ("--set", s)), home=home, env=env)
    assert shown.returncode == 0, shown.stderr
    rows = [line[1:].split(maxsplit=4) for line in shown.stdout.splitlines() if line.startswith("#   ")]
    return {"config": shown.stdout, **{r[0]: r[-1] for r in rows}}


@pytest.mark.timeout(900)
def test_a_plugin_stage_runs_between_two_real_stages_and_follows_the_cache_rules(baton_home, plugin):
    folder, env = plugin
    planned = _planned(baton_home, env)
    assert "\nexample:\n  min_rows: 10\n" in planned.pop("config")
    assert list(planned)[:3] == ["data", "example", "pretrain"] and planned["example"].endswith("to run: new")

    first = _run(baton_home, env)
    assert list(first)[:3] == ["data", "example", "pretrain"]
    example = first["example"]
    assert example["status"] == "completed" and example["gate"]["passed"], example
    rows = example["metrics"]["pretrain_train_rows"]
    assert rows >= 10 and [c["name"] for c in example["gate"]["checks"]][0] == "example.preference"
    assert first["pretrain"]["status"] == "completed"

    from mlflow import MlflowClient

    store = f"sqlite:///{baton_home / 'mlflow.db'}"
    logged = MlflowClient(tracking_uri=store).get_run(example["mlflow_run_id"]).data
    assert logged.metrics["summary/pretrain_train_rows"] == rows, logged.metrics
    assert logged.params["stage.min_rows"] == "10", logged.params

    again = _planned(baton_home, env)
    assert [again[k].split()[-1] for k in ("data", "example", "pretrain")] == ["cached"] * 3, again["config"][-800:]

    task = folder / "task.py"
    task.write_text(task.read_text() + "\n# an edit to the stage's own code\n")
    edited = _run(baton_home, env)
    assert edited["example"]["status"] == "completed"
    assert edited["example"]["reason"] == [{"why": "code changed", "detail": ["example_stage/task.py"]}]
    assert edited["data"]["status"] == edited["pretrain"]["status"] == "cached"  # the example writes no checkpoint

@pytest.mark.fast
@pytest.mark.parametrize("modules, says", [
    ("no_such_stage_module", "BATON_STAGES: no_such_stage_module: No module named 'no_such_stage_module'"),
    ("example_stage,example_stage", "BATON_STAGES: stage 'example' is already registered")])
def test_a_plugin_that_cannot_register_stops_the_command_in_one_line(baton_home, modules, says):
    r = baton("config", str(TINY), home=baton_home,
              env={"BATON_STAGES": modules, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}, timeout=120)
    assert (r.returncode, r.stderr.strip()) == (2, f"baton: {says}")
