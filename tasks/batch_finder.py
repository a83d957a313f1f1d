"""The batch-size finder: the largest micro-batch that fits, found by real probes ("start small and grow it").

Doubles the micro-batch from 1 until a probe fails (GPU: out of memory; CPU: peak RSS above the budget less the margin),
then bisects between the last size that fit and the first that did not. Each probe is the stage's own engine run —
the worker spec and launch command the stage task builds (its StageSpec.batch_probe: DeepSpeed for finetune,
Megatron-Core under torchrun for pretrain), on the configured ranks, for a few training steps at the candidate
micro-batch — and its measurement is every rank's peak as the worker itself reports it (ru_maxrss, or CUDA's max
allocated), the numbers memory monitoring puts beside the plan.
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tasks import launch
from tasks.stage import StageContext

OOM = re.compile(r"out of memory|OutOfMemoryError|MemoryError|Killed|exitcode\s*:\s*-9|signal 9|SIGKILL", re.I)


def largest_fitting(fits: Callable[[int], bool], limit: int = 4096) -> int:
    """Largest m in [1, limit] with fits(m), assuming fits is monotone (0 when even 1 does not fit)."""
    good, bad, m = 0, None, 1
    while m <= limit:
        if not fits(m):
            bad = m
            break
        good, m = m, m * 2
    if good == 0:
        return 0
    hi = bad if bad is not None else limit + 1
    while hi - good > 1:
        mid = (good + hi) // 2
        if fits(mid):
            good = mid
        else:
            hi = mid
    return good


def probe_config(cfg, micro: int, steps: int, per_step: int = 1, **more):
    """The stage config of one probe: `micro` per rank, `per_step` micro-batches of them per rank in a step, `steps`
    steps, the lr schedule without warm-up, and what else the stage's probe sets (`more`)."""
    update = {"micro_batch_size": micro, "global_batch_size": micro * cfg.data_parallel() * per_step,
              "gradient_accumulation_steps": None, "steps": steps, "warmup_steps": 0, **more}
    return type(cfg).model_validate({**cfg.model_dump(), **update})


def peaks_of(res: launch.LaunchResult, device: str) -> dict:
    """Every rank's peak (MiB) from the worker's events: the pretrain worker's result (its `memory`), the finetune
    worker's last step metric (the same fields the stage's memory monitoring reads)."""
    found: dict = {}
    for e in res.events:
        fields = {**e, **(e.get("memory") or {})}
        found.update({k: v for k, v in fields.items() if k.endswith("peak_mem_mib") or k.endswith("gpu_allocated_mib")})
    rss = [v for k, v in found.items() if re.fullmatch(r"(perf/)?rank\d+_peak_mem_mib", k)]
    gpu = [v for k, v in found.items() if re.fullmatch(r"rank\d+_peak_gpu_allocated_mib", k)]
    if device == "cuda" and not gpu:  # the finetune worker reports CUDA's max allocated as its peak on a GPU
        gpu, rss = rss, []
    return {"peak_rss_mb": max(rss) if rss else None, "gpu_peak_mb": max(gpu) if gpu else None,
            "rank_peaks_mb": gpu if device == "cuda" else rss}


@dataclass
class EngineProber:
    """Probes of one training stage: `ctx` carries its inputs (data, checkpoint, runtimes) and a scratch `work_dir`
    under which each probe gets its own folder (removed after it; its engine.log kept). Remembers every
    measurement."""
    stage: str
    ctx: StageContext
    cfg: object                         # the stage's config model (resolved)
    probe: Callable                     # the stage's StageSpec.batch_probe: (ctx, cfg, micro, steps) -> command
    steps: int = 2
    timeout: float = 1800
    measured: dict = field(default_factory=dict)      # micro-batch -> probe result

    def __post_init__(self):
        self.device = self.cfg.resolved_device()

    def run(self, micro: int) -> dict:
        if micro not in self.measured:
            self.measured[micro] = self._probe(micro)
        return self.measured[micro]

    def _probe(self, micro: int) -> dict:
        from dataclasses import replace

        work = Path(self.ctx.work_dir) / f"micro-{micro}"
        ctx = replace(self.ctx, work_dir=work, run_dir=work)
        cmd, env, port = self.probe(ctx, self.cfg, micro, self.steps)
        log = Path(self.ctx.work_dir) / f"micro-{micro}.log"
        t0 = time.time()
        try:
            res = launch.run(cmd, env=env, timeout=self.timeout, log_path=log, name=f"{self.stage} probe {micro}")
        except launch.LaunchError as e:
            if e.returncode is not None and (OOM.search("\n".join(e.tail)) or e.returncode in (-9, 137)):
                return {"micro_batch": micro, "oom": True, "peak_rss_mb": None, "gpu_peak_mb": None,
                        "rank_peaks_mb": [], "seconds": round(time.time() - t0, 1), "log": str(log)}
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
            if port:
                from tasks.distributed import remove_shm_segments

                remove_shm_segments(port)
        return {"micro_batch": micro, "oom": False, **peaks_of(res, self.device),
                "seconds": round(res.seconds, 1), "log": str(log)}


def find(prober, budget_mb: float | None, margin: float = 0.1, limit: int = 4096) -> int:
    """The largest micro-batch whose probe stays within budget × (1 - margin) MiB on its busiest rank (CPU: peak
    RSS), or does not run out of memory and stays within it (GPU: budget_mb is the device's memory)."""
    allowed = budget_mb * (1 - margin) if budget_mb else None

    def fits(m: int) -> bool:
        r = prober.run(m)
        if r["oom"]:
            return False
        peak = r["gpu_peak_mb"] if prober.device == "cuda" else r["peak_rss_mb"]
        return allowed is None or peak <= allowed

    return largest_fitting(fits, limit)
