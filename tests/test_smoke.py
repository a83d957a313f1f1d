"""`baton run --smoke`: the smoke config (few steps, smallest layouts, one engine, no promotion) and `require_smoke`."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows import smoke
from flows.config import load

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
RECIPE = TINY.parent / "recipes" / "llama3-70b-8x8xh100.yaml"


@pytest.mark.fast
def test_smoke_config_is_small_and_valid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a host without GPUs, whatever this one has
    cfg = smoke.smoke_config(load(RECIPE, check_stages=False))
    assert cfg.smoke  # off its cluster only the host checks fail: GPUs, and the cluster's data files
    assert cfg.validate_stages() == [
        "data.pretrain.train: /data/pretrain/train-*.jsonl matches no file (a file, a folder or a glob)",
        "data.pretrain.heldout: /data/pretrain/heldout-*.jsonl matches no file (a file, a folder or a glob)",
        "pretrain.nproc_per_node 1: this machine has 0 GPU(s); more ranks than it can host"]
    p = cfg.pretrain
    assert (p.steps, p.nproc_per_node, p.nnodes, p.tensor_parallel, p.pipeline_parallel) == (4, 1, 1, 1, 1)
    assert p.global_batch() == p.micro_batch_size
    tiny = smoke.smoke_config(load(TINY))
    assert tiny.validate_stages() == []
    assert tiny.serve.engine == "vllm" and not tiny.serve.promote and tiny.finetune.nproc_per_node == 1


@pytest.mark.fast
def test_fingerprint_ignores_the_flags_only():
    cfg = load(TINY)
    assert smoke.fingerprint(cfg) == smoke.fingerprint(cfg.model_copy(update={"require_smoke": True}))
    assert smoke.fingerprint(cfg) != smoke.fingerprint(load(TINY, ["pretrain.steps=61"]))


@pytest.mark.fast
def test_quality_checks_do_not_fail_a_smoke_stage():
    gate = {"passed": False, "checks": [{"name": "L0.integrity", "passed": True},
                                        {"name": "eval.heldout_exact_match", "passed": False}]}
    assert smoke.smoke_gate_passed(gate)
    gate["checks"][0]["passed"] = False
    assert not smoke.smoke_gate_passed(gate)


@pytest.mark.fast
def test_require_smoke_refuses_a_full_run_without_a_passing_smoke(tmp_path):
    env = dict(os.environ, BATON_HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "flows.cli", "run", str(TINY), "--set", "require_smoke=true", "--stages", "data"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "no passing smoke run of this config" in r.stderr
    os.environ["BATON_HOME"], old = str(tmp_path), os.environ.get("BATON_HOME")
    try:  # what a passing `--smoke` run records, for the same config
        cfg = load(TINY, ["require_smoke=true"], ["data"])
        smoke.record(cfg, {"run_id": "r", "run_dir": "d", "status": "completed"})
        assert smoke.passing_smoke(cfg)["run_id"] == "r"
        assert smoke.passing_smoke(load(TINY, ["require_smoke=true", "pretrain.steps=5"], ["data"])) is None
    finally:
        os.environ.pop("BATON_HOME") if old is None else os.environ.__setitem__("BATON_HOME", old)


@pytest.mark.slow
@pytest.mark.long  # the whole chain at smoke size, vLLM included (~4 min): make test-long
@pytest.mark.timeout(1500)
def test_the_readme_smoke_run_passes_every_stage_promotes_nothing_and_unlocks_require_smoke(baton_home):
    import json

    from conftest import baton
    from tasks import tracking

    r = baton("run", str(TINY), "--smoke", home=baton_home, timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "smoke passed; recorded" in r.stdout, r.stdout[-3000:]
    run_dir = Path(r.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "pretrain", "convert-megatron-to-hf", "rlhf", "finetune", "convert-zero-to-hf",
                            "export", "serve"]
    exported = stages["export"]["side_outputs"]
    # at smoke size the first type only, and never registered
    assert list(exported) == ["f16"] and not any(e.get("registered") for e in exported.values()), exported
    assert all(s["status"] == "completed" for s in stages.values()), {k: s["status"] for k, s in stages.items()}
    assert stages["serve"]["engine"] == "vllm"  # one engine at smoke size
    aliases = {a for rm in tracking.client().search_registered_models() for a in (rm.aliases or {})}
    assert "champion" not in aliases, aliases  # a smoke never promotes
    recorded = smoke.passing_smoke(load(TINY, ["require_smoke=true"]))
    assert recorded is not None and recorded["run_id"] == run_dir.name
