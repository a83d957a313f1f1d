"""The learning-rate schedule baton writes into ds_config.json, run through DeepSpeed's own scheduler classes the way
its engine steps them (the scheduler steps after each optimizer step; before its first step it gives lr 0)."""
from __future__ import annotations

import pytest

from flows.config import load
from conftest import TINY

pytestmark = pytest.mark.fast


def _applied_lrs(section: dict, lr: float, steps: int) -> list[float]:
    import torch
    from deepspeed.runtime import lr_schedules

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section["params"])
    applied = []
    for _ in range(steps):
        applied.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return applied


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_no_warmup_updates_at_the_full_rate_from_the_second_step(schedule):
    from tasks.finetune.ds_config import scheduler_section

    cfg = load(TINY).finetune.model_copy(update={"warmup_steps": 0, "steps": 3, "lr": 2e-5, "lr_schedule": schedule})
    lrs = _applied_lrs(scheduler_section(cfg), cfg.lr, 3)
    assert lrs[1] == pytest.approx(2e-5), lrs  # the cosine's first step is DeepSpeed's lr 0; the next is the full rate


def test_warmup_rises_linearly_from_zero():
    from tasks.finetune.ds_config import scheduler_section

    cfg = load(TINY).finetune.model_copy(update={"warmup_steps": 4, "steps": 20, "lr": 1e-3})
    lrs = _applied_lrs(scheduler_section(cfg), cfg.lr, 5)
    assert lrs == pytest.approx([0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4]), lrs
