"""Mixture-of-experts pretraining throughput by layout: the pretrain stage's own task body (Megatron-Core, 2 CPU
ranks over gloo) on configs/tiny-moe.yaml's model, dense (model.moe removed), EP1, EP2 and EP2 × TP2 (sequence
parallel, whole experts per rank: expert_tensor_parallel 1); the median training tokens/s of each run (the stage's
own `tokens_per_s`, steps after the first).

    .venv/bin/python benchmarks/moe_bench.py [--steps 30] [--layouts dense,ep1,ep2,ep2-tp2]   (make bench runs it)

Results to benchmarks/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
RESULTS = REPO / "benchmarks" / "results"
CONFIG = REPO / "configs" / "tiny-moe.yaml"

LAYOUTS = {
    "dense": ["model.moe=null", "pretrain.expert_parallel=1"],
    "ep1": ["pretrain.expert_parallel=1"],
    "ep2": ["pretrain.expert_parallel=2"],
    "ep2-tp2": ["pretrain.expert_parallel=2", "pretrain.tensor_parallel=2", "pretrain.sequence_parallel=true",
                "pretrain.expert_tensor_parallel=1"],
}


def run_layout(work: Path, data: Path, name: str, steps: int) -> dict:
    from flows.config import load
    from tasks.pretrain.task import run_pretrain
    from tasks.stage import StageContext

    cfg = load(CONFIG, [*LAYOUTS[name], f"pretrain.steps={steps}", f"pretrain.checkpoint_every={steps}",
                        f"pretrain.eval_interval={steps}", "pretrain.eval_iters=1", "pretrain.warmup_steps=2"],
               stages=["data", "pretrain"])
    d = work / name
    ctx = StageContext(stage="pretrain", run_id="bench", run_dir=d, work_dir=d, model=cfg.model.model_dump(), seed=0,
                       data_dir=data)
    t0 = time.time()
    out = run_pretrain.fn(ctx, cfg.pretrain)
    return {"layout": out.backend, "tokens_per_s": round(out.metrics["tokens_per_s"]),
            "train_time_s": round(out.metrics["train_time_s"], 1), "loss_last": round(out.metrics["loss_last"], 4),
            "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    from flows.config import load
    from gpu_check import make_data

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="baton-moe-bench-") as tmp:
        work = Path(tmp)
        data = make_data(work, load(CONFIG, stages=["data", "pretrain"]))
        rows = {}
        for name in a.layouts.split(","):
            rows[name] = run_layout(work, data, name, a.steps)
            print(f"{name:8} {rows[name]['layout']:28} {rows[name]['tokens_per_s']:>8,} tok/s  "
                  f"(loss {rows[name]['loss_last']}, {rows[name]['wall_s']} s)", flush=True)
    result = {"config": str(CONFIG.relative_to(REPO)), "steps": a.steps, "machine": platform.machine(),
              "cores": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "layouts": rows,
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {a.out}")


if __name__ == "__main__":
    main()
