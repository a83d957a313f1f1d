"""Packing's speed-up (finetune.packing): training tokens per second with and without packing, on the tiny model and
the tiny default world's real SFT conversations (the data stage's output, rendered with the checkpoint's chat template
by the finetune worker's own encoding and collation), forward + backward + AdamW step, one process.

    .venv/bin/python benchmarks/packing_bench.py [--steps 30] [--threads 2]   (make bench runs it)
    .venv/bin/python benchmarks/packing_bench.py --model HF_DIR --window 256 --out benchmarks/results/packing_X.json

--model: a real HF checkpoint instead of the random-init tiny model (e.g. SmolLM2-135M-Instruct, `make real-models`
then `baton import gguf:PATH HF_DIR`): the same conversations, encoded with its tokenizer and chat template, trained
from its weights (fp32); --window: the packing window (default the tiny model's seq_length).

Tokens are the real (non-padding) tokens trained on. Unpacked: `finetune.micro_batch_size` rows padded to the longest
in the batch (configs/tiny.yaml: 16); packed: windows of `max_seq_length` with the same number of real tokens per step
on average (micro batch = 16 × mean example length / window fill), so the two do the same work. Results to
benchmarks/results/packing.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = REPO / "benchmarks" / "results"


def examples(cfg, work: Path, window: int, model_dir: Path | None = None):
    """The tiny world's SFT training conversations, encoded as the finetune worker encodes them (with the tiny world's
    tokenizer, or the real model's)."""
    from tasks.data.task import write_data
    from tasks.finetune import worker
    from tasks.stage import StageContext
    from transformers import AutoTokenizer

    ctx = StageContext(stage="data", run_id="bench", run_dir=work, work_dir=work, model=cfg.model.model_dump(), seed=0)
    write_data(ctx, cfg.data)
    tok = AutoTokenizer.from_pretrained(str(model_dir or work / "tokenizer"))
    rows = worker.read_jsonl(work / "sft" / "train.jsonl")
    encoded, _ = worker.encode_rows(tok, rows, window, "drop")
    return tok, encoded


def model_for(cfg, tok, model_dir: Path | None = None):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from conversions import hf

    if model_dir is not None:
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = hf.llama_config(cfg.model.model_dump(), vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def tokens_per_s(model, batches, steps: int) -> list[float]:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    rates = []
    for i in range(steps + 2):  # two warm-up steps
        batch, real = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            rates.append(real / (time.perf_counter() - t0))
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", type=Path, default=RESULTS / "packing.json")
    ap.add_argument("--model", type=Path, help="a real HF checkpoint folder (default: the random-init tiny model)")
    ap.add_argument("--window", type=int, help="packing window in tokens (default: the tiny model's seq_length)")
    a = ap.parse_args(argv)
    import torch

    from flows.config import load
    from tasks.finetune import worker

    torch.set_num_threads(a.threads)
    cfg = load(REPO / "configs" / "tiny.yaml")
    window, rows = a.window or cfg.model.seq_length, cfg.finetune.micro_batch_size
    with tempfile.TemporaryDirectory() as tmp:
        tok, encoded = examples(cfg, Path(tmp), window, a.model)
    windows = worker.pack(encoded, window)
    fill = sum(len(x) for x, _ in encoded) / (len(windows) * window)
    per_window = max(1, round(rows * statistics.mean(len(x) for x, _ in encoded) / (window * fill)))
    unpacked = [worker.collate(encoded[i:i + rows], tok.pad_token_id) for i in range(0, len(encoded) - rows, rows)]
    packed = [worker.collate_packed(windows[i:i + per_window], tok.pad_token_id, window)
              for i in range(0, len(windows) - per_window, per_window)]
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": a.threads, "load_1min": os.getloadavg()[0]},
              "model": a.model.name if a.model else "tiny (random init)", "examples": len(encoded), "windows": len(windows), "window_fill": round(fill, 3),
              "rows_per_step": rows, "windows_per_step": per_window, "steps": a.steps}
    for name, batches in (("unpacked", unpacked), ("packed", packed)):
        rates = tokens_per_s(model_for(cfg, tok, a.model), batches, a.steps)
        result[name] = {"tokens_per_s_median": round(statistics.median(rates)), "tokens_per_step": round(
            statistics.mean(real for _, real in batches))}
    result["machine"]["load_1min_end"] = os.getloadavg()[0]  # the other processes sharing the cores while it timed
    result["speedup"] = round(result["packed"]["tokens_per_s_median"] / result["unpacked"]["tokens_per_s_median"], 3)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"packing, {result['model']}, {result['examples']} SFT examples → {result['windows']} windows of {window} "
          f"(fill {fill:.0%}), {a.threads} threads, load {result['machine']['load_1min']:.1f} → "
          f"{result['machine']['load_1min_end']:.1f}")
    for name in ("unpacked", "packed"):
        r = result[name]
        print(f"  {name:<9} {r['tokens_per_s_median']:>8} tokens/s  ({r['tokens_per_step']} real tokens a step)")
    print(f"  speed-up  {result['speedup']}×   → {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
