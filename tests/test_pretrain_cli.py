"""Acceptance through the real CLI: `baton run configs/tiny.yaml --stages data,pretrain,convert` passes every gate,
and the MLflow pretrain run shows the loss falling by at least 30% and held-out perplexity."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import TINY, baton


def test_tiny_data_pretrain_convert_passes_every_gate(baton_home):
    r = baton("run", str(TINY), "--stages", "data,pretrain,convert", home=baton_home, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    run_dir = Path(r.stdout.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "pretrain", "convert-megatron-to-hf"]
    for s in stages.values():
        assert s["status"] == "completed", s
        assert s["gate"]["passed"], s["gate"]
    pre, conv = stages["pretrain"], stages["convert-megatron-to-hf"]
    assert {c["name"] for c in pre["gate"]["checks"]} >= {"L0.integrity", "L1.reload", "probe_logits"}
    assert {c["name"] for c in conv["gate"]["checks"]} >= {"L0.integrity", "L1.roundtrip", "L2.logits_parity",
                                                          "L3.generation", "preflight.tied_embeddings"}
    assert pre["eval"]["metric"] == "heldout_ppl" and pre["eval"]["after"] < pre["eval"]["before"]
    assert pre["registered"]["alias"] == "candidate"

    from tasks import tracking

    c = tracking.client()
    loss = sorted(c.get_metric_history(pre["mlflow_run_id"], "train/loss"), key=lambda m: m.step)
    assert len(loss) == 60 and loss[0].step == 1
    assert loss[-1].value <= 0.7 * loss[0].value, (loss[0].value, loss[-1].value)
    ppl = sorted(c.get_metric_history(pre["mlflow_run_id"], "eval/heldout_ppl"), key=lambda m: m.step)
    assert [m.step for m in ppl] == [0, 20, 40, 60] and ppl[-1].value < ppl[0].value
    for name in ("train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s", "perf/mfu"):
        assert c.get_metric_history(pre["mlflow_run_id"], name), name
