"""What baton costs on a real model: training tokens/s under `baton run` vs a bare HF/PyTorch loop, in one run.

    .venv/bin/python benchmarks/real_model_bench.py HF_DIR WORK RESULT.json [--rlhf-steps 5] [--finetune-steps 5]
        [--no-mlflow]

Contenders (baton first: its data stage writes the rows all of them train on):
- baton: one `baton run configs/real-smollm2.yaml --from HF_DIR --stages data,rlhf,finetune --no-cache`, steps set
  with `--set`, in a private BATON_HOME. Per-step figures are the stages' own metric events in their engine.log:
  finetune `perf/tokens_per_s` (real tokens of all ranks / rank 0's step time); rlhf the step's tokens (the
  increase of TRL's running `train/num_tokens`) / `perf/step_time_s` (TRL's optimizer step, begin → end). rlhf is
  TRL DPO (+ the SFT term of `rlhf.sft_weight`) in one process, finetune DeepSpeed ZeRO-2 (torch AdamW) on 2 CPU
  ranks; every rank has OMP_NUM_THREADS=1 (tasks/stage.py `training_engine_env`).
- bare: a plain loop in one process, `torch.set_num_threads` (and OMP_NUM_THREADS) = the threads of baton's ranks
  together, on the same model (finetune: the baton run's rlhf output, which its finetune read), the same data stage
  output, max length, batch per optimizer step, lr, weight decay and grad clip, `torch.optim.AdamW`:
  - finetune: the very rows `tasks.finetune.worker` gives every rank at every step (`encode_rows`, `sample_ids`,
    `collate`: same seed and positions), one forward/backward per rank's micro batch (the ranks' shapes; gradients
    averaged as their all-reduce does), then one optimizer step; tokens/s = real tokens / step time.
  - rlhf: DPO steps on the pairs the worker trains on (its `format_pairs`, `drop_overlong`, `trl_pairs`), tokenized
    as TRL 1.16 does (prompt and prompt+reply with the tokenizer's special tokens, the reply from where the two
    diverge, keep-start truncation to max length, chosen then rejected rows in one right-padded batch): the policy's
    forward, a frozen reference copy's forward without grad, the sigmoid DPO loss at the config's beta plus the SFT
    term, backward, clip, step. Its batches follow a seeded shuffle of those pairs, not TRL's sampler: the same
    pairs and batch size, not the same pairs per step, hence tokens/s (unpadded tokens, as TRL counts them).
- the engine alone (to split the cost): the stage's worker command as its task builds it (overhead_bench.bare: same
  config, environment, data and input), run directly, its events read from its stdout. baton vs it is what
  orchestration costs (launcher, Prefect, MLflow, and whatever else baton runs beside the engine on the same cores);
  it vs the bare loop is what the engine itself costs (TRL's Trainer, DeepSpeed, its extra metrics).
Order: the baton run (data, rlhf, finetune), then per stage the engine alone and the bare loop, back to back.
The first step of each contender is warm-up and left out; medians over the rest. Ratio = baton tokens/s / bare
tokens/s; target ≥ 0.9. The machine (cores, load average before and after each contender) goes with the numbers: on
a shared machine they are rough.
"""
from __future__ import annotations

import argparse
import copy
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
CONFIG = REPO / "configs" / "real-smollm2.yaml"
TARGET = 0.9
STAGES = ("rlhf", "finetune")
NUM_TOKENS = "train/num_tokens"  # TRL's running count of the (unpadded) tokens trained on, as the rlhf worker streams it


# ---- pure: reading events and judging ------------------------------------------------------------------------------
def step_series(lines, key: str) -> list[float]:
    """The value of metric `key` at each step of the @@baton metric events among lines, in step order (the
    worker's last report of a step wins)."""
    from tasks import events

    by_step = {}
    for line in lines:
        e = events.parse(line)
        if e and e["kind"] == "metric" and isinstance(e.get(key), (int, float)):
            by_step[e["step"]] = float(e[key])
    return [by_step[s] for s in sorted(by_step)]


def rates(cumulative_tokens: list[float], step_times: list[float]) -> list[float]:
    """Tokens/s per step from a running token count (TRL's num_tokens) and each step's time."""
    per_step = [b - a for a, b in zip([0.0] + cumulative_tokens, cumulative_tokens)]
    return [t / dt for t, dt in zip(per_step, step_times)]


def compare(baton: list[float], bare: list[float], higher_is_better: bool, warmup: int = 1) -> dict:
    """Medians after the warm-up steps, and baton's throughput relative to bare (≥ TARGET: met)."""
    ours, theirs = baton[warmup:], bare[warmup:]
    if not ours or not theirs:
        return {"baton_median": None, "bare_median": None, "ratio": None, "met": None, "steps_compared": 0}
    a, b = statistics.median(ours), statistics.median(theirs)
    ratio = a / b if higher_is_better else b / a
    return {"baton_median": round(a, 4), "bare_median": round(b, 4), "ratio": round(ratio, 4),
            "met": ratio >= TARGET, "steps_compared": min(len(ours), len(theirs))}


def machine_load() -> dict:
    return {"cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()],
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}


# ---- the bare loops (run in a child process: its own thread count, nothing of the parent's imports) ----------------
def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    torch.manual_seed(0)


def new_timings() -> dict:
    return {"step_times": [], "tokens_per_s": [], "cpu_s": []}


def optimizer_step(model, opt, clip: float, t0: float, c0: float, tokens: int, timed: dict) -> None:
    """Clip, step, and time the optimizer step that began at t0 (wall) and c0 (CPU) over `tokens` real tokens."""
    import torch

    if clip and clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    timed["step_times"].append(dt)
    timed["cpu_s"].append(time.process_time() - c0)
    timed["tokens_per_s"].append(tokens / dt)


def bare_finetune(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.finetune.worker import collate, encode_rows, param_groups, read_jsonl, sample_ids

    _threads(spec["threads"])
    ds = json.loads(Path(spec["ds_config"]).read_text())
    mb, ga, world = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], spec["world"]
    tok = AutoTokenizer.from_pretrained(spec["input"])
    train, _ = encode_rows(tok, read_jsonl(Path(spec["data"]) / "sft" / "train.jsonl"), spec["max_seq_length"],
                           spec["overlong"])
    model = AutoModelForCausalLM.from_pretrained(spec["input"], dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, spec["weight_decay"]), lr=spec["lr"])
    clip, cache, timed = ds.get("gradient_clipping", 0), {}, new_timings()
    for step in range(spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = 0
        for micro in range(ga):
            for rank in range(world):  # what each rank computes, one after the other
                position = ((step * ga + micro) * world + rank) * mb
                batch, real = collate([train[i] for i in sample_ids(len(train), spec["seed"], position, mb, cache)],
                                      tok.pad_token_id)
                (model(**batch).loss / (ga * world)).backward()
                tokens += real
        optimizer_step(model, opt, clip, t0, c0, tokens, timed)
    return timed


def trl_tokens(tok, pair: dict, max_len: int) -> tuple[list[int], list[int]] | None:
    """(ids, completion mask) of prompt+chosen and prompt+rejected as TRL 1.16 builds them; None when the prompt
    alone fills max_len (TRL drops those)."""
    p = tok(pair["prompt"])["input_ids"]
    full = {side: tok(pair["prompt"] + pair[side])["input_ids"] for side in ("chosen", "rejected")}
    n = min(_common_prefix(p, f) for f in full.values())
    if n >= max_len:
        return None
    out = []
    for side in ("chosen", "rejected"):
        ids = full[side][:max_len]
        out.append((ids, [0] * n + [1] * (len(ids) - n)))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def dpo_batch(encoded: list, pad_id: int):
    """Chosen rows then rejected rows, right-padded: (ids, attention mask, completion mask)."""
    import torch

    rows = [e[0] for e in encoded] + [e[1] for e in encoded]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    att, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (x, m) in enumerate(rows):
        ids[i, :len(x)], att[i, :len(x)], comp[i, :len(x)] = torch.tensor(x), 1, torch.tensor(m)
    return ids, att, comp


def sequence_logps(model, ids, att, comp):
    """Sum of log p over each row's completion tokens."""
    import torch

    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1]
    per_token = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (per_token * comp[:, 1:]).sum(-1)


def bare_rlhf(spec: dict) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.rlhf.worker import drop_overlong, format_pairs, read_jsonl, trl_pairs

    _threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(spec["input"])
    pairs, _ = drop_overlong(tok, format_pairs(tok, read_jsonl(Path(spec["data"]) / "preference" / "train.jsonl")),
                             spec["max_seq_length"], spec["overlong"])
    encoded = [e for e in (trl_tokens(tok, p, spec["max_seq_length"]) for p in trl_pairs(tok, pairs)) if e]
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(spec["seed"])).tolist()
    model = AutoModelForCausalLM.from_pretrained(spec["input"], dtype=torch.float32)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    mb, ga, beta = spec["micro_batch_size"], spec["accumulation"], spec["beta"]
    timed, pos = new_timings(), 0
    for _ in range(spec["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = 0
        for _ in range(ga):
            picked = [encoded[order[(pos + i) % len(order)]] for i in range(mb)]
            pos += mb
            ids, att, comp = dpo_batch(picked, tok.pad_token_id)
            chosen, rejected = sequence_logps(model, ids, att, comp).chunk(2)
            with torch.no_grad():
                ref_chosen, ref_rejected = sequence_logps(ref, ids, att, comp).chunk(2)
            loss = -F.logsigmoid(beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).mean()
            if spec["sft_weight"]:  # RPO, as the worker asks TRL for: NLL of the chosen replies' tokens
                loss = loss - spec["sft_weight"] * chosen.sum() / comp[:len(picked), 1:].sum()
            (loss / ga).backward()
            tokens += int(att.sum())
        optimizer_step(model, opt, spec["grad_clip"], t0, c0, tokens, timed)
    all_tokens = [len(chosen[0]) + len(rejected[0]) for chosen, rejected in encoded]
    return {**timed, "pairs": len(encoded), "mean_tokens_per_step": mb * ga * statistics.mean(all_tokens)}


BARE = {"rlhf": bare_rlhf, "finetune": bare_finetune}


def run_bare(stage: str, spec: dict, work: Path) -> dict:
    """The bare loop of a stage in a child process with the given thread count (OMP_NUM_THREADS too)."""
    work.mkdir(parents=True, exist_ok=True)
    (work / f"bare-{stage}.json").write_text(json.dumps(spec, indent=2))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TORCHDYNAMO_DISABLE="1")
    before = machine_load()
    p = subprocess.run([sys.executable, __file__, "--bare", stage, str(work / f"bare-{stage}.json")], env=env,
                       capture_output=True, text=True)
    (work / f"bare-{stage}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"bare {stage} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return {**out, "threads": spec["threads"], "load_before": before["load_average"],
            "load_after": machine_load()["load_average"]}


def run_engine_alone(stage: str, cfg, work: Path, data: Path, src: Path) -> list[str]:
    """The stage's worker command as its task builds it, run without baton (overhead_bench.bare): its stdout lines."""
    from overhead_bench import bare

    before = machine_load()["load_average"]
    bare(stage, cfg, work, data, src)
    print(f"[real-model] {stage} engine alone: load {before} → {machine_load()['load_average']}", flush=True)
    return (work / "worker.out").read_text(errors="replace").splitlines()


def throughput(stage: str, lines: list[str]) -> list[float]:
    """Tokens/s per step from a worker's events: finetune reports it; rlhf's from TRL's running token count."""
    from tasks import events

    if stage == "finetune":
        return step_series(lines, events.TOKENS_PER_S)
    return rates(step_series(lines, NUM_TOKENS), step_series(lines, events.STEP_TIME_S))


def stage_row(stage: str, baton_lines: list[str], engine_lines: list[str], b: dict) -> dict:
    """baton vs the bare loop (the target), and the split: baton vs its engine alone (orchestration), the engine
    alone vs the bare loop (the engine's own cost)."""
    ours, engine = throughput(stage, baton_lines), throughput(stage, engine_lines)
    row = {"unit": "tokens/s" + (" (same pairs and batch size; not the same pairs per step)" if stage == "rlhf"
                                 else " (the same rows at every step)"),
           **compare(ours, b["tokens_per_s"], higher_is_better=True),
           "baton_vs_engine_alone": compare(ours, engine, higher_is_better=True)["ratio"],
           "engine_alone_vs_bare": compare(engine, b["tokens_per_s"], higher_is_better=True)["ratio"],
           "baton_series": [round(x, 2) for x in ours], "engine_alone_series": [round(x, 2) for x in engine],
           "bare_series": [round(x, 2) for x in b["tokens_per_s"]],
           "bare_cpu_s_per_step": [round(x, 2) for x in b["cpu_s"]]}  # below its step time: it waited for a core
    if stage == "rlhf":
        row.update(mean_tokens_per_step=round(b["mean_tokens_per_step"], 1), pairs=b["pairs"])
    return row


# ---- the measurement -----------------------------------------------------------------------------------------------
def baton_sets(rlhf_steps: int, finetune_steps: int) -> list[str]:
    return [f"rlhf.steps={rlhf_steps}", f"rlhf.checkpoint_every={rlhf_steps}", f"finetune.steps={finetune_steps}",
            f"finetune.checkpoint_every={finetune_steps}"]


def measure(hf_dir: Path, work: Path, rlhf_steps: int, finetune_steps: int) -> dict:
    from flows.config import load
    from overhead_bench import baton_run
    from tasks import events

    sets = baton_sets(rlhf_steps, finetune_steps)
    cfg = load(CONFIG, sets)
    res: dict = {"model": Path(hf_dir).name, "config": str(CONFIG.relative_to(REPO)), "sets": sets,
                 "order": "baton run (data, rlhf, finetune); then per stage the engine alone, the bare loop",
                 "started": time.strftime("%FT%TZ", time.gmtime()), "machine_at_start": machine_load()}
    print("[real-model] baton run", flush=True)
    r = baton_run(work / "home", sets, "data,rlhf,finetune", CONFIG, ("--from", str(hf_dir)))
    res["baton_run"] = {"wall_s": round(r["wall_s"], 1), "exit_code": r["exit_code"],
                        "load_after": machine_load()["load_average"]}
    entries = {s["name"]: s for s in r["summary"]["stages"]}
    logs = {n: (Path(entries[n]["log"]).parent / "engine.log").read_text(errors="replace").splitlines()
            for n in STAGES}
    data = entries["data"]["output"]
    threads = {"rlhf": cfg.rlhf.world_size(), "finetune": cfg.finetune.nproc_per_node * cfg.finetune.nnodes}
    common = {"data": data, "seed": cfg.seed}
    rl, ft = cfg.rlhf, cfg.finetune
    specs = {
        "rlhf": {**common, "input": str(hf_dir), "threads": threads["rlhf"], "steps": rlhf_steps,
                 "micro_batch_size": rl.micro_batch_size, "accumulation": rl.accumulation(), "lr": rl.lr,
                 "beta": rl.beta, "max_seq_length": rl.max_seq_length, "overlong": rl.overlong,
                 "grad_clip": rl.grad_clip, "weight_decay": rl.weight_decay, "sft_weight": rl.sft_weight},
        "finetune": {**common, "input": entries["rlhf"]["output"], "threads": threads["finetune"],
                     "world": threads["finetune"], "steps": finetune_steps, "lr": ft.lr,
                     "max_seq_length": ft.max_seq_length, "overlong": ft.overlong, "weight_decay": ft.weight_decay,
                     "ds_config": str(Path(entries["finetune"]["log"]).parent / "ds_config.json")},
    }
    res["stages"] = {}
    for stage in STAGES:
        print(f"[real-model] {stage}: the engine alone, then the bare loop ({threads[stage]} threads)", flush=True)
        engine_lines = run_engine_alone(stage, cfg, work / f"engine-{stage}", Path(data),
                                        Path(specs[stage]["input"]))
        b = run_bare(stage, specs[stage], work / "bare")
        row = stage_row(stage, logs[stage], engine_lines, b)
        row.update(baton_threads=f"{threads[stage]} rank(s) × OMP_NUM_THREADS=1",
                   bare_threads=f"1 process, torch.set_num_threads({b['threads']})",
                   bare_load_before=b["load_before"], bare_load_after=b["load_after"])
        res["stages"][stage] = row
    res["machine_at_end"] = machine_load()
    res["finished"] = time.strftime("%FT%TZ", time.gmtime())
    res["verdict"] = {s: v["met"] for s, v in res["stages"].items()}
    return res


def log_mlflow(res: dict) -> str:
    from tasks import events, tracking

    c = tracking.client()
    run = c.create_run(tracking.experiment_id(c, "baton-benchmarks"), run_name="real-model",
                       tags={"benchmark": "real-model"})
    rid = run.info.run_id
    for stage, row in res["stages"].items():
        for key in ("baton_median", "bare_median", "ratio"):
            if row[key] is not None:
                c.log_metric(rid, events.checked(f"perf/real_{stage}_{key}"), row[key])
    c.log_dict(rid, res, "real_model.json")
    c.set_terminated(rid)
    return rid


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--bare":  # the child process of run_bare
        print(json.dumps(BARE[sys.argv[2]](json.loads(Path(sys.argv[3]).read_text()))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="an HF folder (e.g. one `baton import gguf:...` wrote)")
    ap.add_argument("work", type=Path)
    ap.add_argument("result", type=Path)
    ap.add_argument("--rlhf-steps", type=int, default=5)
    ap.add_argument("--finetune-steps", type=int, default=5)
    ap.add_argument("--no-mlflow", action="store_true")
    a = ap.parse_args(argv)
    res = measure(a.model.resolve(), a.work.resolve(), a.rlhf_steps, a.finetune_steps)
    a.result.write_text(json.dumps(res, indent=2) + "\n")  # first: a tracking server that is down loses nothing
    if not a.no_mlflow:
        res["mlflow_run_id"] = log_mlflow(res)
        a.result.write_text(json.dumps(res, indent=2) + "\n")
    for stage, row in res["stages"].items():
        print(f"{stage}: baton {row['baton_median']} vs bare {row['bare_median']} ({row['unit']}): ratio "
              f"{row['ratio']} ({'met' if row['met'] else 'missed'} ≥ {TARGET})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
