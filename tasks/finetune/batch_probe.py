"""The batch-size finder's probes: a few real training steps of the model at one micro-batch size each, reporting the
peak memory. Runs in the engine runtime; imports torch once, then forks one child per probe (a child's peak RSS is
its own), so a probe costs seconds, not an interpreter start.

    python tasks/finetune/batch_probe.py --arch ARCH.json --seq 128 [--steps 2] [--device cpu]
    stdin: one micro-batch size per line; stdout: {"ready": true}, then one JSON line per probe:
    {"micro_batch", "peak_rss_mb", "gpu_peak_mb", "oom"}
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # conversions


def train_steps(arch: dict, micro: int, seq: int, steps: int, device: str) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from conversions import hf

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf.llama_config(arch, vocab_size=arch["vocab_size"])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    oom = False
    try:
        for _ in range(steps):
            ids = torch.randint(0, arch["vocab_size"], (micro, seq), device=device)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    except torch.cuda.OutOfMemoryError:
        oom = True
    gpu = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return {"micro_batch": micro, "oom": oom, "gpu_peak_mb": gpu,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def probe_in_child(arch: dict, micro: int, seq: int, steps: int, device: str) -> dict:
    """Fork, train in the child (its peak RSS is its own), read its answer; a child the kernel kills ran out."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = train_steps(arch, micro, seq, steps, device)
        except MemoryError:
            out = {"micro_batch": micro, "oom": True, "gpu_peak_mb": None, "peak_rss_mb": None}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if not text:  # killed (OOM killer) before answering
        return {"micro_batch": micro, "oom": True, "gpu_peak_mb": None, "peak_rss_mb": None,
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
    return json.loads(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=Path, required=True, help="JSON of the pipeline's model: section")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    import torch  # noqa: F401  imported once here; every probe forks from this process
    import transformers  # noqa: F401

    arch = json.loads(a.arch.read_text())
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(probe_in_child(arch, int(line), a.seq, a.steps, a.device)), flush=True)


if __name__ == "__main__":
    main()
