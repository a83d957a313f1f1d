"""`baton batch` probes of fine-tuning: the stage's own DeepSpeed launch, with the worker's probe flag."""
from __future__ import annotations


def probe(ctx, cfg, micro: int, steps: int) -> tuple[list[str], dict, int]:
    """(command, environment, DeepSpeed's rendezvous port). One micro-batch per step (accumulation does not add to the
    peak), a metric every step (the peaks are read from the last)."""
    from tasks.batch_finder import probe_config
    from tasks.finetune.task import prepare

    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    cmd, env, _, port = prepare(ctx, probe_config(cfg, micro, steps, log_every=1), probe=True)
    return cmd, ctx.worker_env(**env), port or 0
