"""The batch-size finder: doubling then bisection over real probes; the largest micro-batch under two CPU budgets."""
from __future__ import annotations

import os
import sys

import pytest

from tasks.batch_finder import Prober, find, largest_fitting


@pytest.mark.fast
@pytest.mark.parametrize("answer", [0, 1, 5, 16, 17, 100, 1024])
def test_largest_fitting_finds_the_boundary(answer):
    tried = []

    def fits(m):
        tried.append(m)
        return m <= answer

    assert largest_fitting(fits, limit=1024) == answer
    assert len(tried) <= 2 * 11  # doubling + bisection: logarithmic


@pytest.mark.slow
def test_largest_micro_batch_under_two_cpu_budgets(tiny_config):
    """Real probes (a few training steps of the tiny model per size); the answer fits and one more does not."""
    arch = tiny_config.model.model_dump()
    with Prober(sys.executable, arch, seq=64, steps=1, env={**os.environ, "OMP_NUM_THREADS": "1"}) as p:
        base = p.run(1)["peak_rss_mb"]
        chosen = {}
        for extra in (20, 80):
            budget = base + extra
            m = find(p, budget, margin=0.0, limit=256)
            peak = {k: v["peak_rss_mb"] for k, v in p.measured.items()}
            assert m >= 1 and peak[m] <= budget
            assert peak[m + 1] > budget, f"{m + 1} would also fit: {peak}"
            chosen[extra] = m
    assert chosen[20] < chosen[80], chosen
