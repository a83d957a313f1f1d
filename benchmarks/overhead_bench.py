"""Orchestration overhead: the tiny pipeline through `baton run` vs the same worker commands run bare.

The bare commands come from the stages' own builders (pretrain `build_spec` + `command`, rlhf `worker_command`,
finetune `prepare`) with the same configs, the same data and the same inputs as the `baton run` (its data stage's output
and its stages' outputs), in fresh work folders. Reported: `baton run` wall time split into Prefect/MLflow start-up and
flow bookkeeping (wall − Σ step times) and the steps; per training stage the step time (engine + packaging + gate +
MLflow) vs the bare worker's wall time; per optimizer step the median step time inside each; and the same for a 10×
longer pretraining run, where the fixed costs should fade.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = REPO / "configs" / "tiny.yaml"
SHORT = ["pretrain.steps=20", "pretrain.checkpoint_every=20", "pretrain.eval_interval=20", "pretrain.warmup_steps=2",
         "rlhf.steps=10", "finetune.steps=20", "finetune.checkpoint_every=20", "finetune.warmup_steps=2"]
TRAINING = ("pretrain", "rlhf", "finetune")


def baton_run(home: Path, sets: list[str], stages: str) -> tuple[float, dict]:
    from flows.cli import QUIET_ENV

    (home / "prefect").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **QUIET_ENV, BATON_HOME=str(home), PREFECT_HOME=str(home / "prefect"))
    env.pop("MLFLOW_TRACKING_URI", None)
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")  # a loaded machine starts it slowly
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY), "--stages", stages, "--no-cache",
                        *(a for s in sets for a in ("--set", s))], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    # a gate may refuse a checkpoint of so short a run (fine-tuning's exact match need not rise in 20 steps): the
    # run still ran every stage and timed it; anything else is a failure of the benchmark
    runs = sorted((home / "runs").glob("*/summary.json"))
    summary = json.loads(runs[-1].read_text()) if runs else {"stages": []}
    ran = {s["name"] for s in summary["stages"] if s.get("seconds") is not None}
    if not set(stages.split(",")) <= ran:
        raise RuntimeError(f"baton run failed:\n{(p.stdout + p.stderr)[-3000:]}")
    summary["exit_code"] = p.returncode
    return wall, summary


def step_times(lines) -> list[float]:
    from tasks import events

    out = []
    for line in lines:
        e = events.parse(line)
        if e and e["kind"] == "metric" and events.STEP_TIME_S in e:
            out.append(e[events.STEP_TIME_S])
    return out


def bare(stage: str, cfg, work: Path, data: Path, src: Path | None) -> dict:
    """The command the stage would launch, built by the stage's own code, run directly."""
    from tasks.stage import StageContext

    work.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(stage=stage, run_id="bare", run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=cfg.seed, data_dir=data, input=src, input_format="hf-safetensors" if src else None)
    if stage == "pretrain":
        from tasks.pretrain import task as t

        spec = t.build_spec(ctx, cfg.pretrain)
        (work / "worker_spec.json").write_text(json.dumps(spec))
        cmd, env = t.command(ctx, cfg.pretrain, work / "worker_spec.json"), {"OMP_NUM_THREADS": "1",
                                                                            "TORCHDYNAMO_DISABLE": "1"}
    elif stage == "rlhf":
        from tasks.rlhf import task as t

        cmd, env = t.worker_command(ctx, cfg.rlhf, work / "checkpoint"), {}
    else:
        from tasks.finetune import task as t

        cmd, env, _, _ = t.prepare(ctx, cfg.finetune)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=dict(os.environ, **ctx.worker_env(**env)), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"bare {stage} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return {"wall_s": round(wall, 2), "step_times": step_times(p.stdout.splitlines())}


def stage_entries(summary: dict) -> dict[str, dict]:
    return {s["name"]: s for s in summary["stages"]}


def engine_step_times(entry: dict) -> list[float]:
    log = Path(entry["output"]).parent / "engine.log"
    return step_times(log.read_text().splitlines()) if log.exists() else []


def median(xs):
    return round(statistics.median(xs), 4) if xs else None


def compare(name: str, entry: dict, b: dict) -> dict:
    ours, theirs = engine_step_times(entry), b["step_times"]
    return {"baton_step_s": entry["seconds"], "bare_worker_s": b["wall_s"],
            "ratio": round(entry["seconds"] / b["wall_s"], 3),
            "median_step_time_s": {"baton": median(ours), "bare": median(theirs)},
            "per_step_ratio": round(median(ours) / median(theirs), 3) if ours and theirs else None}


def run(work: Path, scale: int = 10) -> dict:
    from flows.config import load

    import shutil

    shutil.rmtree(work, ignore_errors=True)
    res: dict = {}
    wall, summary = baton_run(work / "home", SHORT, "data,pretrain,rlhf,finetune")
    entries = stage_entries(summary)
    cfg = load(TINY, SHORT)
    data = Path(entries["data"]["output"])
    inputs = {"pretrain": None, "rlhf": Path(_hf_before(summary, "rlhf")), "finetune": Path(entries["rlhf"]["output"])}
    stages = {}
    for name in TRAINING:
        stages[name] = compare(name, entries[name], bare(name, cfg, work / f"bare-{name}", data, inputs[name]))
    steps_total = sum(s.get("seconds") or 0 for s in summary["stages"])
    res["short"] = {
        "baton_wall_s": round(wall, 2), "exit_code": summary["exit_code"],
        "gates": {s["label"]: (s.get("gate") or {}).get("passed") for s in summary["stages"]}, "steps_s": {s["label"]: s["seconds"] for s in summary["stages"]},
        "startup_and_flow_s": round(wall - steps_total, 2), "stages": stages,
        "training_stages_ratio": round(sum(v["baton_step_s"] for v in stages.values())
                                       / sum(v["bare_worker_s"] for v in stages.values()), 3),
        "whole_run_ratio": round(wall / sum(v["bare_worker_s"] for v in stages.values()), 3)}
    long_sets = [f"pretrain.steps={20 * scale}", f"pretrain.checkpoint_every={20 * scale}",
                 f"pretrain.eval_interval={20 * scale}", "pretrain.warmup_steps=2"]
    wall, summary = baton_run(work / "home-long", long_sets, "data,pretrain")
    entries = stage_entries(summary)
    b = bare("pretrain", load(TINY, long_sets), work / "bare-long", Path(entries["data"]["output"]), None)
    res["long_pretrain"] = {"steps": 20 * scale, "baton_wall_s": round(wall, 2), **compare("pretrain", entries["pretrain"], b)}
    return res


def _hf_before(summary: dict, stage: str) -> str:
    """The HF checkpoint a stage read: the output of the step just before it (the conversion after pretraining)."""
    names = [s["name"] for s in summary["stages"]]
    return summary["stages"][names.index(stage) - 1]["output"]


if __name__ == "__main__":  # overhead_bench.py WORK_DIR RESULT.json
    Path(sys.argv[2]).write_text(json.dumps(run(Path(sys.argv[1])), indent=2) + "\n")
