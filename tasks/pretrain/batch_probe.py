"""`baton batch` probes of pretraining: the stage's own worker spec and torchrun command, with the probe flag."""
from __future__ import annotations


def probe(ctx, cfg, micro: int, steps: int) -> tuple[list[str], dict, int]:
    """(command, environment, rendezvous port to clean up or 0). A step keeps PP micro-batches per rank (1F1B's first
    stage holds up to PP of them)."""
    from tasks import events
    from tasks.batch_finder import probe_config
    from tasks.pretrain.task import build_spec, command, engine_env

    cfg = probe_config(cfg, micro, steps, per_step=cfg.pipeline_parallel)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    spec = build_spec(ctx, cfg, probe=True)
    path = events.write_spec(ctx.work_dir / "worker_spec.json", spec)
    return command(ctx, cfg, path), ctx.worker_env(**engine_env(spec.device)), 0
