"""GRPO on a real model (configs/real-smollm2-grpo.yaml): held-out reward over seeds, and rollouts HF vs vLLM.

    .venv/bin/python benchmarks/real_grpo_bench.py HF_DIR WORK --seeds 0 1 --out benchmarks/results/real_grpo.json
    .venv/bin/python benchmarks/real_grpo_bench.py HF_DIR WORK --engines hf vllm --steps 3 \\
        --out benchmarks/results/real_grpo_engines.json

HF_DIR is SmolLM2-135M-Instruct imported from its GGUF (`make real-models`, `baton import gguf:PATH HF_DIR`). Each
contender is one `baton run configs/real-smollm2-grpo.yaml --from HF_DIR --stages data,rlhf` in a BATON_HOME of its
own under WORK, run one after another (`--set` as listed): `--seeds` runs the whole recipe with `seed` and
`data.seed` set to each (another held-out split, prompt draw and sampling), `--engines` the same seed with
`rlhf.rollout_engine` set to each for `--steps` steps. What each records, from the run's summary.json and the rlhf
stage's engine.log: exit code, gate passed, held-out reward and solved fraction before/after, per step the training
reward and rollout/step times (the stage's `perf/*` metrics), their means after the first step, and the machine's
load average before and after (a shared machine: times are rough; compare engines within one file). `--read`
records runs already made (each its BATON_HOME) the same way, without the launch facts (set, exit code, load).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
CONFIG = REPO / "configs" / "real-smollm2-grpo.yaml"
SERIES = {"reward": "train/reward", "completion_length": "train/completions_mean_length",
          "step_time_s": "perf/step_time_s", "rollout_time_s": "perf/rollout_time_s",
          "rollout_tokens_per_s": "perf/rollout_tokens_per_s", "rollout_logp_diff": "train/rollout_logp_diff",
          "engine_sync_s": "train/engine_sync_s"}
from real_model_bench import step_series  # noqa: E402  (the @@baton metric events per step, one reader)

TIMES = ("step_time_s", "rollout_time_s", "rollout_tokens_per_s", "rollout_logp_diff", "engine_sync_s")


def mean_after_first(values: list[float]) -> float | None:
    """The first step pays for warm-up (the engine's first request, lazy init): left out when there are others."""
    rest = values[1:] or values
    return sig(statistics.mean(rest)) if rest else None


def sig(x: float) -> float:
    """4 significant digits: times and rates, and log-prob gaps of 1e-5 alike."""
    return float(f"{x:.4g}")


def run_one(hf_dir: Path, home: Path, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "flows.cli", "run", str(CONFIG), "--stages", "data,rlhf", "--from", str(hf_dir),
           "--no-doctor"] + [x for s in sets for x in ("--set", s)]
    home.mkdir(parents=True, exist_ok=True)
    load_before, t0 = os.getloadavg(), time.time()
    with open(home / "baton.out", "w") as out:
        rc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, BATON_HOME=str(home)), stdout=out,
                            stderr=subprocess.STDOUT).returncode
    wall, load_after = time.time() - t0, os.getloadavg()
    return {"set": sets, "exit_code": rc, "wall_s": round(wall, 1), "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in load_after], **read_run(home)}


def read_run(home: Path) -> dict:
    """What the newest run under a BATON_HOME says about its rlhf stage: gate, held-out reward, per-step series."""
    found = sorted(home.glob("runs/*/summary.json"))
    if not found:
        return {"status": None}
    summary = json.loads(found[-1].read_text())
    (stage,) = [s for s in summary["stages"] if s["label"] == "rlhf"]
    lines = (found[-1].parent / Path(stage["log"]).parent.name / "engine.log").read_text().splitlines()
    series = {name: step_series(lines, key) for name, key in SERIES.items()}
    metrics, ev = stage.get("metrics") or {}, stage.get("eval") or {}
    return {"run_dir": str(found[-1].parent), "status": stage["status"],
            "gate_passed": (stage.get("gate") or {}).get("passed"), "heldout_prompts": ev.get("heldout_prompts"),
            "heldout_reward_before": ev.get("before"), "heldout_reward_after": ev.get("after"),
            "heldout_solved_before": ev.get("solved_before"), "heldout_solved_after": ev.get("solved_after"),
            "stage_wall_s": metrics.get("wall_s"),
            "means_after_first_step": {name: mean_after_first(series[name]) for name in TIMES},
            "per_step": {name: [sig(x) for x in v] for name, v in series.items() if v}}


def write(out: Path, res: dict) -> None:
    from conversions import durable

    durable.write_bytes(out, (json.dumps(res, indent=1) + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("hf_dir", type=Path)
    p.add_argument("work", type=Path)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--seeds", type=int, nargs="+")
    group.add_argument("--engines", nargs="+", choices=["hf", "vllm"])
    group.add_argument("--read", nargs="+", metavar="LABEL=HOME", help="record finished runs (a BATON_HOME each, "
                                                                       "e.g. a `baton run` made by hand), run nothing")
    p.add_argument("--steps", type=int, default=3, help="--engines: GRPO steps per engine")
    p.add_argument("--seed", type=int, default=0, help="--engines: the seed of every engine's run")
    p.add_argument("--set", dest="sets", action="append", default=[], help="another --set for every run")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    res = {"config": str(CONFIG.relative_to(REPO)), "model": str(a.hf_dir), "cores": os.cpu_count(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "runs": []}
    if a.read is not None:
        for label, home in (x.split("=", 1) for x in a.read):
            res["runs"].append({"label": label, **read_run(Path(home))})
        write(a.out, res)
        return
    if a.seeds is not None:
        contenders = [(f"seed{s}", [f"seed={s}", f"data.seed={s}"]) for s in a.seeds]
    else:
        contenders = [(e, [f"seed={a.seed}", f"data.seed={a.seed}", f"rlhf.rollout_engine={e}",
                           f"rlhf.steps={a.steps}"]) for e in a.engines]
    for label, sets in contenders:
        run = run_one(a.hf_dir, a.work / label, sets + a.sets)
        res["runs"].append({"label": label, **run})
        print(json.dumps({k: run.get(k) for k in ("set", "exit_code", "gate_passed", "heldout_reward_before",
                                                  "heldout_reward_after", "means_after_first_step")}), flush=True)
        write(a.out, res)


if __name__ == "__main__":
    main()
