"""The README's second command, `make demo-rl` (`baton run configs/tiny-grpo.yaml`), as a newcomer runs it: data →
pretrain → rlhf with GRPO on the arithmetic world, and the gate passes on a held-out reward that rises over many
held-out sums, not one. ~3-5 min on 2 shared cores, so `long` (make test-long); make test runs GRPO's rewards, gate and
step-time metrics at reduced size (tests/test_rlhf_trl.py::test_grpo_with_verifiable_rewards_raises_the_held_out_reward).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import baton

DEMO = Path(__file__).resolve().parents[1] / "configs" / "tiny-grpo.yaml"
# The margin measured over the recorded runs (benchmarks/results/demo-rl.md): the smallest held-out rise seen, in
# sums newly solved of the 22 held-out ones.
MIN_NEWLY_SOLVED = 2


@pytest.mark.long
@pytest.mark.timeout(900)
def test_demo_rl_passes_its_gate_on_a_held_out_rise_of_many_sums(baton_home):
    res = baton("run", str(DEMO), home=baton_home, timeout=880)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(next((baton_home / "runs").glob("*/summary.json")).read_text())
    rlhf = next(s for s in summary["stages"] if s["label"] == "rlhf")
    assert rlhf["gate"]["passed"], rlhf["gate"]
    ev = rlhf["eval"]
    held = ev["heldout_prompts"]
    assert ev["metric"] == "heldout_reward" and held >= 20, ev
    newly_solved = round((ev["solved_after"] - ev["solved_before"]) * held)
    assert ev["after"] > ev["before"] and newly_solved >= MIN_NEWLY_SOLVED, ev
    assert 0 < rlhf["metrics"]["rollout_share"] < 1, rlhf["metrics"]
    print(f"demo-rl: held-out reward {ev['before']:.3f} → {ev['after']:.3f}, solved +{newly_solved} of {held}; "
          f"rollouts {rlhf['metrics']['rollout_share']:.0%} of the step")
