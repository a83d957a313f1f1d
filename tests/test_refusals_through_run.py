"""What `baton run` does when a stage's output is refused, as a user meets it: a training gate that says no (rlhf,
finetune) and a pretraining run whose loss goes non-finite. Each time: exit 1, the stages after it not run, nothing
registered, the stage's MLflow run (and the parent) FAILED, one line naming the cause on the terminal, and the run
folder keeping the evidence (the refused checkpoint, the gate's checks, the step log)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import TINY, baton, mlflow_client

pytestmark = [pytest.mark.slow, pytest.mark.reliability, pytest.mark.long]
SMALL_PRETRAIN = ("--set", "pretrain.steps=4", "--set", "pretrain.warmup_steps=1", "--set", "pretrain.checkpoint_every=4",
                  "--set", "pretrain.eval_interval=4")
IMPOSSIBLE = "1000"  # held-out improvement asked of the gate: no metric it reads can rise or fall by that much


def external(hf_checkpoint: Path, tmp_path: Path) -> Path:
    """A user's HF checkpoint (the session's random-init tiny model, copied: the fixture is read-only)."""
    return Path(shutil.copytree(hf_checkpoint, tmp_path / "model"))


def run_summary(home: Path) -> dict:
    (summary,) = (home / "runs").glob("*/summary.json")
    return json.loads(summary.read_text())


def stage_folder(home: Path, stage: str) -> Path:
    """The stage's folder in the run folder (runs/<run>/<NN>-<stage>)."""
    (folder,) = (home / "runs").glob(f"*/*-{stage}")
    return folder


def assert_refused(r, home: Path, stage: str, later: str, cause: str) -> dict:
    """The common half: exit code, terminal line, summary, MLflow, registry; returns the stage's summary entry."""
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-2000:]
    failed = [line for line in r.stdout.splitlines() if line.startswith(f"✗ {stage} failed")]
    assert len(failed) == 1 and re.search(cause, failed[0]), r.stdout[-4000:]
    assert "Traceback" not in r.stdout, r.stdout[-4000:]
    summary = run_summary(home)
    assert summary["status"] == "failed"
    stages = {s["label"]: s for s in summary["stages"]}
    entry = stages[stage]
    assert entry["status"] == "failed"
    assert later not in stages or stages[later]["status"] in ("not run", "skipped"), summary
    c = mlflow_client(home)
    assert c.get_run(summary["mlflow_run_id"]).info.status == "FAILED"
    assert c.get_run(entry["mlflow_run_id"]).info.status == "FAILED"
    assert c.search_model_versions() == [], [(v.name, v.version) for v in c.search_model_versions()]
    return entry


@pytest.mark.parametrize("stage, later, sets", [
    ("rlhf", "finetune", ("--set", "rlhf.steps=2", "--set", f"rlhf.gate.min_improvement={IMPOSSIBLE}")),
    ("finetune", "serve", ("--set", "finetune.steps=2", "--set", "finetune.warmup_steps=0",
                           "--set", f"finetune.gate.min_improvement={IMPOSSIBLE}")),
])
def test_a_training_gate_that_says_no_ends_the_run(stage, later, sets, baton_home, tmp_path, hf_checkpoint):
    r = baton("run", str(TINY), "--stages", f"{stage},{later}", "--from", str(external(hf_checkpoint, tmp_path)),
              *sets, home=baton_home, timeout=900)
    entry = assert_refused(r, baton_home, stage, later, r"gate")
    checks = entry["gate"]["checks"]
    assert not entry["gate"]["passed"] and any(not c["passed"] and "eval." in c["name"] for c in checks), checks
    folder = stage_folder(baton_home, stage)
    assert (folder / "step.log").is_file() and any(folder.rglob("*.safetensors")), sorted(folder.rglob("*"))[:20]


def test_pretraining_that_diverges_ends_the_run_naming_its_non_finite_weights(baton_home):
    """At lr 1e12 the weights go non-finite while the training loss stays finite (6.30 at every step): the gate's
    finite-weights check names it; before it, the run failed only on the reload check's "None"."""
    r = baton("run", str(TINY), "--stages", "data,pretrain,rlhf", *SMALL_PRETRAIN, "--set", "pretrain.lr=1e12",
              "--set", "pretrain.min_lr=1e11", home=baton_home, timeout=900)
    entry = assert_refused(r, baton_home, "pretrain", "rlhf", r"weights\.finite")
    (finite,) = [c for c in entry["gate"]["checks"] if c["name"] == "weights.finite"]
    assert not finite["passed"] and "are not finite" in finite["detail"], finite
    assert any(stage_folder(baton_home, "pretrain").rglob("*.distcp")), "the refused checkpoint is kept as evidence"
