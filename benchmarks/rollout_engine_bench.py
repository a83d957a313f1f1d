"""GRPO rollouts: TRL's HF `generate` against the vLLM engine (rlhf.rollout_engine: vllm), tokens per second.

    .venv/bin/python benchmarks/rollout_engine_bench.py CHECKPOINT [--tokens 64] [--prompts 16] [--group 4]

Samples prompts × group completions of exactly --tokens tokens each (temperature 1, EOS ignored) from an HF folder,
first with `model.generate` in this process (twice: cold, warm), then through a vLLM server from the vllm runtime
started the way the rlhf worker starts it (tasks/rlhf/engine_rollouts.py; three requests). Prints one line each.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def hf_rates(ckpt: Path, prompts: list[list[int]], tokens: int, pad: int, reps: int = 2) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    rates = []
    for _ in range(reps):
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, max_new_tokens=tokens,
                           min_new_tokens=tokens, pad_token_id=pad)
        rates.append(len(prompts) * tokens / (time.perf_counter() - started))
    return rates


def engine_rates(ckpt: Path, prompts: list[list[int]], tokens: int, log: Path, reps: int = 3) -> tuple[float, list]:
    from tasks import runtimes
    from tasks.rlhf import engine_rollouts as er

    started = time.perf_counter()
    server = er.start_vllm(runtimes.python_for("vllm"), ckpt, log)
    healthy = time.perf_counter() - started
    try:
        client, rates = er.EngineClient(server, []), []
        for _ in range(reps):
            started = time.perf_counter()
            got = client.complete(prompts, tokens, {"temperature": 1.0, "ignore_eos": True})
            rates.append(sum(len(s.ids) for s in got) / (time.perf_counter() - started))
        return healthy, rates
    finally:
        server.stop()


def main() -> None:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--log", type=Path, default=Path("/tmp/rollout_engine_bench_vllm.log"))
    a = p.parse_args()
    tok = AutoTokenizer.from_pretrained(str(a.checkpoint))
    prompts = [tok(f"Question {i}: what is {i} + {i}?")["input_ids"] for i in range(a.prompts) for _ in range(a.group)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    print(f"{len(prompts)} completions x {a.tokens} tokens; torch threads {torch.get_num_threads()}", flush=True)
    print("hf generate tokens/s (cold, warm):", [round(r) for r in hf_rates(a.checkpoint, prompts, a.tokens, pad)],
          flush=True)
    healthy, rates = engine_rates(a.checkpoint, prompts, a.tokens, a.log)
    print(f"vllm healthy in {healthy:.0f} s; tokens/s per request:", [round(r) for r in rates], flush=True)


if __name__ == "__main__":
    main()
