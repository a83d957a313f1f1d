"""GRPO with the calculator tool after a short SFT (configs/tiny-tools.yaml): held-out episode reward before → after
GRPO, per seed, SFT length and GRPO learning rate.

    .venv/bin/python benchmarks/tool_grpo_bench.py WORK --seeds 0 1 --sft-steps 300 --lrs 1e-4 \\
        --out benchmarks/results/tool_grpo.json

Each seed's data (the calculator task with data.seed = seed: another split of products) and random-init tiny model
are made once under WORK/seedN, SFT'd once per --sft-steps (finetune stage, then convert to HF; kept under
WORK/seedN/sftM and reused by later calls), and GRPO runs from that checkpoint once per --lrs with the config's rlhf
section (and --set's rlhf keys). Stages are called in-process as
tests/test_rlhf_tool_sft.py calls them: pretraining is left out (SFT starts from a random init). Records per GRPO run
the gate's held-out episode reward before and after, held-out tool calls, the training reward per step, the run's
time and the machine's load. Results are appended to --out (one row per run; a rerun of the same key replaces it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
CONFIG = REPO / "configs" / "tiny-tools.yaml"
KEYS = ("lr", "steps", "temperature", "num_generations", "micro_batch_size", "gradient_accumulation_steps",
        "loss_type", "scale_rewards")
from real_model_bench import step_series  # noqa: E402  (the @@baton metric events per step, one reader)
from tasks.data.synthetic import BY_HEART_FRACTION, tool_episode  # noqa: E402

BY_HEART_EXAMPLE = tool_episode(37, 48, by_heart=True)[-1]["content"]  # how the SFT data answers by heart


def ctx(stage: str, work: Path, cfg, seed: int, data: Path | None, src: Path | None, fmt: str | None, **kw):
    from tasks.stage import StageContext

    work.mkdir(parents=True, exist_ok=True)
    return StageContext(stage=stage, run_id=f"tool-grpo-{seed}", run_dir=work, work_dir=work,
                        model=cfg.model.model_dump(), seed=seed, data_dir=data, input=src, input_format=fmt, **kw)


def prepare(root: Path, cfg, seed: int) -> tuple[Path, Path]:
    """The seed's data (its own tokenizer) and random-init model, once."""
    from checkpoints import make_hf_checkpoint
    from conversions import hf, manifest as mf
    from tasks.data.task import write_data

    data, init = root / "data", root / "init"
    if not (init / "manifest.json").exists():
        data.mkdir(parents=True, exist_ok=True)
        arch = cfg.model.model_dump()
        write_data(ctx("data", data, cfg, seed, None, None, None),
                   cfg.data.model_copy(update={"pretrain_docs": 50, "preference_pairs": 10, "seed": seed}))
        mf.write(data, mf.build(data, format="dataset", stage="data", tokenizer_dir=data / "tokenizer"))
        make_hf_checkpoint(init, arch, data / "tokenizer")
        mf.write(init, mf.build(init, format="hf-safetensors", stage="external",
                                parameter_count=hf.parameter_count(init), dtype="float32", architecture=arch))
    return data, init


def sft(root: Path, cfg, seed: int, data: Path, init: Path, steps: int) -> Path:
    """SFT for `steps` steps and its HF conversion, once per (seed, steps): the converted folder."""
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import run_convert
    from tasks.finetune.task import run_finetune

    done = root / f"sft{steps}" / "done.json"
    if done.exists():
        return Path(json.loads(done.read_text())["output"])
    t0 = time.monotonic()
    out = run_finetune.fn(ctx("finetune", root / f"sft{steps}" / "finetune", cfg, seed, data, init, "hf-safetensors"),
                          cfg.finetune.model_copy(update={"steps": steps, "checkpoint_every": steps,
                                                          "timeout_s": 2400}))
    c = ctx("convert", root / f"sft{steps}" / "convert", cfg, seed, data, out.output, "deepspeed-zero",
            extra={"from_format": "deepspeed-zero", "to_format": "hf-safetensors"})
    conv = run_convert.fn(c, ConvertConfig())
    row = {"output": str(conv.output), "sft_s": round(time.monotonic() - t0), "load_1m": round(os.getloadavg()[0], 1),
           "loss_first": out.metrics["loss_first"], "loss_last": out.metrics["loss_last"],
           "heldout_answer_before": out.eval["before"], "heldout_answer_after": out.eval["after"]}
    done.write_text(json.dumps(row, indent=2))
    print(f"seed {seed} sft {steps}: {row}", flush=True)
    return conv.output


def grpo(root: Path, cfg, seed: int, data: Path, model: Path, tag: str, update: dict) -> dict:
    from tasks.rlhf.task import run_rlhf

    t0, load0 = time.monotonic(), os.getloadavg()[0]
    rlhf = type(cfg.rlhf).model_validate(cfg.rlhf.model_dump(exclude_unset=True) | {"timeout_s": 1800, **update})
    out = run_rlhf.fn(ctx("rlhf", root / tag, cfg, seed, data, model, "hf-safetensors"), rlhf)
    m, engine_log = out.metrics, root / tag / "engine.log"
    return {"reward_before": round(out.eval["before"], 3), "reward_after": round(out.eval["after"], 3),
            "solved_before": round(m["heldout_solved_before"], 3), "solved_after": round(m["heldout_solved_after"], 3),
            "heldout_tool_calls_before": m.get("heldout_tool_calls_before"),
            "heldout_tool_calls_after": m.get("heldout_tool_calls_after"),
            "training_tool_calls": m.get("tool_calls"), "episodes_trained": m.get("episodes_trained"),
            "ends": {k[len("episode_end_"):]: v for k, v in m.items() if k.startswith("episode_end_") and v},
            "train_reward": [round(x, 3) for x in step_series(engine_log.read_text().splitlines(), "train/reward")],
            "train_tool_calls": [round(x, 2) for x in step_series(engine_log.read_text().splitlines(),
                                                                  "train/episodes_tool_calls")],
            "gate_passed": bool(out.gate["passed"]), "grpo_s": round(time.monotonic() - t0),
            "load_1m": [round(load0, 1), round(os.getloadavg()[0], 1)]}


def table(rows: list[dict]) -> str:
    """One markdown row per GRPO run: what was tried and the greedy held-out episodes before → after."""
    lines = ["| seed | by heart | answered by heart as | SFT steps | GRPO | rewards | held-out solved before → after | "
             "tool calls | training reward first → last 5 | run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        episodes = r["micro_batch_size"] * (r.get("gradient_accumulation_steps") or 1)
        grpo_keys = (f"lr {r['lr']:g}, {r['steps']} steps × {episodes // r['num_generations']} prompts × "
                     f"{r['num_generations']}, T {r['temperature']}, {r['loss_type']}/{r['scale_rewards']}"
                     + (f", beta {r['beta']}" if r.get("beta") else ""))
        rewards = "+ digits" if len(r.get("rewards", [])) > 1 else "exact"
        solved = (r.get("solved_before", r["reward_before"]), r.get("solved_after", r["reward_after"]))
        train = r.get("train_reward") or []
        first, last = (sum(train[:5]) / len(train[:5]), sum(train[-5:]) / len(train[-5:])) if train else (None, None)
        lines.append(f"| {r['seed']} | {r['by_heart']} | `{r.get('by_heart_example', '1776')}` | "
                     f"{r['sft_steps']} | {grpo_keys} | {rewards} | "
                     f"{solved[0]:.3f} → {solved[1]:.3f} | {r['heldout_tool_calls_before']} → "
                     f"{r['heldout_tool_calls_after']} of 32 | "
                     + (f"{first:.3f} → {last:.3f}" if train else "") + f" | {r['grpo_s']} s |")
    return "\n".join(lines)


def main() -> int:
    from flows.config import load

    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--sft-steps", type=int, nargs="+", default=[300])
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-4])
    ap.add_argument("--by-heart", type=float, default=None, help="data.sft's by_heart (else the config's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="rlhf keys for every GRPO run (YAML values), e.g. steps=30 temperature=0.5")
    ap.add_argument("--table", action="store_true", help="print --out's runs as a markdown table, run nothing")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tool_grpo.json")
    a = ap.parse_args()
    cfg = load(CONFIG)
    if a.by_heart is not None:
        sft_source = cfg.data.sft.model_copy(update={"by_heart": a.by_heart})
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"sft": sft_source})})
    by_heart = cfg.data.sft.by_heart  # None: the task's default (recorded as its value)
    sets = {k: yaml.safe_load(v) for k, v in (x.split("=", 1) for x in a.set)}
    rows = json.loads(a.out.read_text())["runs"] if a.out.exists() else []
    if a.table:
        print(table(rows))
        return 0
    for seed in a.seeds:
        root = a.work / (f"seed{seed}" if by_heart is None else f"seed{seed}-by_heart{by_heart}")
        data, init = prepare(root, cfg, seed)
        for steps in a.sft_steps:
            model = sft(root, cfg, seed, data, init, steps)
            for lr in a.lrs:
                update = {**sets, "lr": lr}
                key = {"seed": seed, "by_heart": BY_HEART_FRACTION if by_heart is None else by_heart,
                       "by_heart_example": BY_HEART_EXAMPLE, "sft_steps": steps,
                       **{k: update.get(k, getattr(cfg.rlhf, k)) for k in KEYS},
                       **{k: v for k, v in sets.items() if k not in KEYS}}
                tag = "grpo-" + "-".join(f"{k}{v}" for k, v in key.items() if k not in ("seed", "rewards"))
                tag += f"-rewards{len(update.get('rewards', cfg.rlhf.rewards))}"
                row = key | grpo(root, cfg, seed, data, model, tag, update)
                print(json.dumps(row), flush=True)
                rows = [r for r in rows if {k: r.get(k) for k in key} != key] + [row]
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps({"config": str(CONFIG.relative_to(REPO)), "runs": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
