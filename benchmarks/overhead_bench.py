"""Orchestration overhead: the tiny pipeline through `baton run` vs the same worker commands run bare.

    .venv/bin/python benchmarks/overhead_bench.py WORK_DIR RESULT.json [--reps 2] [--quick]

The bare commands come from the stages' own builders (pretrain `build_spec` + `command`, rlhf `worker_command` with
the chat template, finetune `prepare`) with the same configs, environments, data and inputs as the `baton run` (its
data stage's output and its stages' outputs), in fresh work folders; their @@baton events are read from their stdout.

Measured, each as median / min / max over the repetitions, the contenders alternating (baton, bare, baton, bare):
- pipeline (data → pretrain → rlhf → finetune, short steps): the `baton run` wall split into Prefect/MLflow start-up
  (process start → the first step's log opens), the steps, and flow bookkeeping (the rest: subflows, MLflow runs
  closed, summary); per training stage the step (engine + packaging + gate + MLflow) vs the bare worker;
- per training stage, the per-step overhead: (the engine's wall time under baton − the bare worker's wall time) /
  steps, over the bare run's median perf/step_time_s; and the median perf/step_time_s inside each (the optimizer
  step itself, which the launcher's log reader could slow through back-pressure on the pipe);
- the same for a 10× longer pretraining run (contenders alternating bare, baton, bare, baton), where the fixed costs
  fade and the ratios should approach 1. Target: per-step overhead ≤ 5%.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = REPO / "configs" / "tiny.yaml"
from tasks.registry import TRAINING_STAGES as TRAINING  # noqa: E402
# optimizer steps per training stage: make bench's profile, and --quick (about 20 min on the loaded 2-core machine)
# (10 pretraining steps are too few: the rlhf gate's L3 generation then gets EOS at once and the run stops there)
PROFILES = {"full": {"pretrain": 20, "rlhf": 10, "finetune": 20}, "quick": {"pretrain": 20, "rlhf": 10, "finetune": 10}}
SCALE = 10  # the longer pretraining run: SCALE × the pipeline's pretraining steps
TARGET = 0.05


def pipeline_sets(steps: dict) -> list[str]:
    p, f = steps["pretrain"], steps["finetune"]
    return [f"pretrain.steps={p}", f"pretrain.checkpoint_every={p}", f"pretrain.eval_interval={p}",
            "pretrain.warmup_steps=2", f"rlhf.steps={steps['rlhf']}", f"finetune.steps={f}",
            f"finetune.checkpoint_every={f}", "finetune.warmup_steps=2"]


def pretrain_sets(steps: int) -> list[str]:
    return [f"pretrain.steps={steps}", f"pretrain.checkpoint_every={steps}", f"pretrain.eval_interval={steps}",
            "pretrain.warmup_steps=2"]


# ---- the contenders ------------------------------------------------------------------------------------------------
def baton_run(home: Path, sets: list[str], stages: str, config: Path = TINY, extra: tuple[str, ...] = ()) -> dict:
    """`baton run CONFIG` (+ extra arguments, e.g. `--from`): its wall time, its start-up (until the first step's log
    opens) and its summary.json."""
    from flows.cli import QUIET_ENV

    shutil.rmtree(home, ignore_errors=True)
    (home / "prefect").mkdir(parents=True)
    env = dict(os.environ, **QUIET_ENV, BATON_HOME=str(home), PREFECT_HOME=str(home / "prefect"))
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "600"  # a loaded machine starts it slowly
    log = open(home / "baton-run.out", "w")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(config), "--stages", stages, "--no-cache", *extra,
                          *(a for s in sets for a in ("--set", s))], cwd=REPO, env=env, stdout=log,
                         stderr=subprocess.STDOUT, text=True)
    startup = None
    while p.poll() is None:
        if startup is None and next((home / "runs").glob("*/00-*/step.log"), None) is not None:
            startup = time.perf_counter() - t0
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    log.close()
    # a gate may refuse a checkpoint of so short a run (fine-tuning's exact match need not rise in 20 steps): the
    # run still ran every stage and timed it; anything else is a failure of the benchmark
    runs = sorted((home / "runs").glob("*/summary.json"))
    summary = json.loads(runs[-1].read_text()) if runs else {"stages": []}
    ran = {s["name"] for s in summary["stages"] if s.get("seconds") is not None}
    if not set(stages.split(",")) <= ran:
        raise RuntimeError(f"baton run failed:\n{(home / 'baton-run.out').read_text()[-3000:]}")
    return {"wall_s": wall, "startup_s": startup, "exit_code": p.returncode, "summary": summary}


def bare_command(stage: str, cfg, ctx, work: Path) -> tuple[list[str], dict]:
    """The command and extra environment the stage's task would launch, built by the stage's own code."""
    from tasks import chat_template, events

    if stage == "pretrain":
        from tasks.pretrain import task as t

        spec = events.write_spec(work / "worker_spec.json", t.build_spec(ctx, cfg.pretrain))
        return t.command(ctx, cfg.pretrain, spec), {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    if stage == "rlhf":
        from tasks.rlhf import task as t

        return (t.worker_command(ctx, cfg.rlhf, work / "checkpoint.partial", chat_template.for_input(ctx)),
                {"OMP_NUM_THREADS": "1"})
    from tasks.finetune import task as t

    cmd, env, _, _ = t.prepare(ctx, cfg.finetune)
    return cmd, env


def bare(stage: str, cfg, work: Path, data: Path, src: Path | None) -> dict:
    """The stage's worker command run directly, in a fresh folder; its events parsed from its stdout."""
    from tasks.stage import StageContext

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ctx = StageContext(stage=stage, run_id="bare", run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=cfg.seed, data_dir=data, input=src, input_format="hf-safetensors" if src else None)
    cmd, env = bare_command(stage, cfg, ctx, work)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=dict(os.environ, **ctx.worker_env(**env)), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / "worker.out").write_text(p.stdout)
    (work / "worker.err").write_text(p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"bare {stage} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return {"wall_s": wall, "step_times": step_times(p.stdout.splitlines())}


# ---- reading what they left ----------------------------------------------------------------------------------------
def step_times(lines) -> list[float]:
    """perf/step_time_s of every metric event among lines."""
    from tasks import events

    out = []
    for line in lines:
        e = events.parse(line)
        if e and e["kind"] == "metric" and isinstance(e.get(events.STEP_TIME_S), (int, float)):
            out.append(e[events.STEP_TIME_S])
    return out


def engine_wall(step_log: Path, stage: str) -> float | None:
    """The wall time of the stage's engine under baton (the launcher's own line in step.log; tasks/streaming.py)."""
    from tasks.streaming import ENGINE_WALL

    for line in step_log.read_text(errors="replace").splitlines():
        m = re.search(re.escape(ENGINE_WALL) + r" (\{.*\})$", line)
        if m and json.loads(m.group(1))["name"].startswith(stage):
            return json.loads(m.group(1))["seconds"]
    return None


def sample(entry: dict, b: dict, stage: str, steps: int) -> dict:
    """One repetition of one stage: baton's step and engine vs the bare worker."""
    work = Path(entry["log"]).parent
    engine = engine_wall(Path(entry["log"]), stage)
    ours, theirs = step_times((work / "engine.log").read_text(errors="replace").splitlines()), b["step_times"]
    bare_step = statistics.median(theirs) if theirs else None
    per_step = (engine - b["wall_s"]) / steps if engine is not None else None
    return {"baton_step_s": entry["seconds"], "baton_engine_s": engine, "bare_worker_s": b["wall_s"],
            "stage_bookkeeping_s": entry["seconds"] - engine if engine is not None else None,
            "ratio": entry["seconds"] / b["wall_s"], "engine_ratio": engine / b["wall_s"] if engine else None,
            "per_step_overhead_s": per_step,
            "per_step_overhead": per_step / bare_step if per_step is not None and bare_step else None,
            "median_step_time_baton_s": statistics.median(ours) if ours else None,
            "median_step_time_bare_s": bare_step,
            "step_time_ratio": statistics.median(ours) / bare_step if ours and bare_step else None}


def stats(values: list) -> dict | None:
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4), "n": len(xs)}


def aggregate(samples: list[dict]) -> dict:
    return {k: stats([s[k] for s in samples]) for k in samples[0]}


def _hf_before(summary: dict, stage: str) -> str:
    """The HF checkpoint a stage read: the output of the step just before it (the conversion after pretraining)."""
    names = [s["name"] for s in summary["stages"]]
    return summary["stages"][names.index(stage) - 1]["output"]


# ---- the two measurements ------------------------------------------------------------------------------------------
def pipeline_rep(work: Path, rep: int, steps: dict) -> tuple[dict, dict]:
    """One repetition: `baton run` of the short pipeline, then each training stage's worker bare on its inputs."""
    from flows.config import load

    sets = pipeline_sets(steps)
    r = baton_run(work / f"home-{rep}", sets, "data,pretrain,rlhf,finetune")
    summary = r["summary"]
    entries = {s["name"]: s for s in summary["stages"]}
    cfg = load(TINY, sets)
    data = Path(entries["data"]["output"])
    inputs = {"pretrain": None, "rlhf": Path(_hf_before(summary, "rlhf")), "finetune": Path(entries["rlhf"]["output"])}
    stages = {}
    for name in TRAINING:
        print(f"[overhead] rep {rep}: bare {name}", flush=True)
        b = bare(name, cfg, work / f"bare-{name}-{rep}", data, inputs[name])
        stages[name] = sample(entries[name], b, name, steps[name])
    steps_total = sum(s.get("seconds") or 0 for s in summary["stages"])
    bare_total = sum(v["bare_worker_s"] for v in stages.values())
    run = {"baton_wall_s": r["wall_s"], "startup_s": r["startup_s"],
           "flow_bookkeeping_s": r["wall_s"] - (r["startup_s"] or 0) - steps_total, "steps_total_s": steps_total,
           "training_stages_ratio": sum(v["baton_step_s"] for v in stages.values()) / bare_total,
           "whole_run_ratio": r["wall_s"] / bare_total}
    facts = {"exit_code": r["exit_code"], "steps_s": {s["label"]: s.get("seconds") for s in summary["stages"]},
             "gates": {s["label"]: (s.get("gate") or {}).get("passed") for s in summary["stages"]},
             "verification_s": {s["label"]: (s.get("gate") or {}).get("seconds") for s in summary["stages"]
                                if (s.get("gate") or {}).get("seconds")}}
    return {"run": run, "stages": stages, "facts": facts}, r


def pipeline(work: Path, reps: int, steps: dict) -> dict:
    samples = []
    for rep in range(reps):
        s, _ = pipeline_rep(work, rep, steps)
        samples.append(s)
    return {"steps": steps, "reps": reps, "order": ["baton", "bare"] * reps, **aggregate([s["run"] for s in samples]),
            "stages": {n: aggregate([s["stages"][n] for s in samples]) for n in TRAINING},
            "facts": [s["facts"] for s in samples]}


def long_pretrain(work: Path, reps: int, steps: int) -> dict:
    """SCALE × longer pretraining: bare, baton, bare, baton, … (the bare runs read the first baton run's data)."""
    from flows.config import load

    sets = pretrain_sets(steps)
    cfg = load(TINY, sets)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import make_data  # the data stage's own writer, with the same config

    shutil.rmtree(work / "long-data", ignore_errors=True)
    data = make_data(work / "long-data", cfg)
    samples, order = [], []
    for rep in range(reps):
        print(f"[overhead] long pretrain rep {rep}: bare, then baton", flush=True)
        b = bare("pretrain", cfg, work / f"bare-long-{rep}", data, None)
        r = baton_run(work / f"home-long-{rep}", sets, "data,pretrain")
        entry = next(s for s in r["summary"]["stages"] if s["name"] == "pretrain")
        samples.append({**sample(entry, b, "pretrain", steps), "baton_wall_s": r["wall_s"],
                        "startup_s": r["startup_s"]})
        order += ["bare", "baton"]
    return {"steps": steps, "reps": reps, "order": order, **aggregate(samples)}


def verdict(res: dict) -> dict:
    """The target, on medians: every stage's optimizer step no slower under baton (step-time ratio ≤ 1 + target), and
    the long run's amortized per-step overhead ≤ target. In the short stages that overhead is the engine's start-up
    jitter (seconds, on a loaded machine) over a few steps: reported, not judged."""
    rows = {**{n: v for n, v in res["pipeline"]["stages"].items()}, "pretrain_long": res["long_pretrain"]}
    out = {}
    for name, v in rows.items():
        o, t = v.get("per_step_overhead"), v.get("step_time_ratio")
        judged = name == "pretrain_long"
        out[name] = {"per_step_overhead": o and o["median"], "step_time_ratio": t and t["median"],
                     "overhead_judged": judged,
                     "met": (not judged or o is None or o["median"] <= TARGET) and (t is None or t["median"] <= 1 + TARGET)}
    return {"target": TARGET, "stages": out}


def machine_load() -> dict:
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), "?")
    return {"cpu": cpu, "cores": os.cpu_count(), "uptime": up, "load_average": [round(x, 2) for x in os.getloadavg()]}


def run(work: Path, reps: int = 2, quick: bool = False, parts: tuple[str, ...] = ("long", "pipeline"),
        out: Path | None = None) -> dict:
    """Both parts (or those named), the result written to `out` after each one (a later failure keeps the first)."""
    steps = PROFILES["quick" if quick else "full"]
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"profile": "quick" if quick else "full", "reps": reps, "machine_at_start": machine_load(),
                 "started": time.strftime("%FT%TZ", time.gmtime())}
    for part in parts:
        if part == "long":
            res["long_pretrain"] = long_pretrain(work, reps, SCALE * steps["pretrain"])
        else:  # --quick: one repetition of the whole pipeline (~25 min here); the long run keeps its repetitions
            res["pipeline"] = pipeline(work, 1 if quick else reps, steps)
        res["machine_at_end"] = machine_load()
        if out:
            out.write_text(json.dumps(res, indent=2) + "\n")
    return finish(res)


def finish(res: dict) -> dict:
    res["finished"] = time.strftime("%FT%TZ", time.gmtime())
    if "pipeline" in res and "long_pretrain" in res:
        res["verdict"] = verdict(res)
    return res


def merge(paths: list[Path]) -> dict:
    """Parts measured by separate invocations (--part), as one result; each keeps its own machine load."""
    parts = [json.loads(p.read_text()) for p in paths]
    res = {**parts[0], "parts": [{k: p.get(k) for k in ("started", "machine_at_start", "machine_at_end")}
                                 for p in parts]}
    for p in parts[1:]:
        res.update({k: v for k, v in p.items() if k in ("long_pretrain", "pipeline")})
    return finish(res)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help=f"steps {PROFILES['quick']}, one pipeline repetition; ~40 min here (both parts)")
    ap.add_argument("--part", choices=("long", "pipeline"), action="append",
                    help="only this part (repeatable); default both")
    ap.add_argument("--merge", type=Path, nargs="+", help="write RESULT from these part results instead of measuring")
    a = ap.parse_args()
    if a.merge:
        a.result.write_text(json.dumps(merge(a.merge), indent=2) + "\n")
    else:
        final = run(a.work, a.reps, a.quick, tuple(a.part or ("long", "pipeline")), a.result)
        a.result.write_text(json.dumps(final, indent=2) + "\n")
