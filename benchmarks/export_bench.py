"""GGUF exports side by side, per type: the file's size, its decode speed under llama-server against HF generate on
the source checkpoint (fp32, PyTorch), and its quality delta as the export gate measures it (rms logit difference in
units of the source logits' std, argmax agreement, mean KL over the gate's probe). Each type is written by the same
export as `baton export` (llama.cpp's converter and llama-quantize, then the gate) and served by the same launch and
checks as `serve.engine: llamacpp` (tasks.serve.llamacpp.check_gguf: greedy parity included).

    .venv/bin/python benchmarks/export_bench.py [CKPT] [--types f16,q8_0,...] [--out results/export.json]

Without CKPT: the tiny model (random init, configs/tiny.yaml's architecture). make bench runs both the tiny model and
SmolLM2-135M-Instruct. Results to benchmarks/results/export_<name>.json.
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
PROMPT = "the apple is a"  # smoke.performance's decode prompt: both engines decode from the same text
NEW_TOKENS = 64


def hf_tokens_per_s(src: Path, repeats: int = 2) -> float:
    """Greedy decode of NEW_TOKENS (EOS ignored) with HF generate, fp32, the best of `repeats` (the first warms up)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
        best = max(best, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0))
    return best


def one_type(src: Path, work: Path, type_name: str, bound: float | None = None) -> dict:
    from tasks.export import run
    from tasks.serve import llamacpp
    from tasks.serve.config import ServeConfig, SmokeConfig

    t0 = time.time()
    outcome = run.export(src, work / type_name, type_name, bound)
    row = {"gate_passed": outcome.report["passed"], "export_s": round(time.time() - t0, 1)}
    logits = next((c for c in outcome.report["checks"] if c["name"] == "gguf.logits"), {})
    row.update({k: logits[k] for k in ("logit_rms", "argmax_agreement", "mean_kl") if k in logits})
    if outcome.published is None:
        return row
    row["size_bytes"] = (outcome.published / "model.gguf").stat().st_size
    cfg = ServeConfig(health_timeout_s=300, smoke=SmokeConfig(parity_prompts=2, parity_tokens=16))
    served = llamacpp.check_gguf(outcome.published, cfg, work / f"serve-{type_name}", hf_dir=src)
    row["served_checks_passed"] = served.report["passed"]
    row["served_failed"] = [f"{c['name']}: {c['detail']}"[:300] for c in served.report["checks"] if not c["passed"]]
    row["llamacpp_tokens_per_s"] = round(served.metrics.get("tokens_per_s") or 0, 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path, nargs="?", help="an HF checkpoint with a manifest (default: the tiny model)")
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_K_M,q5_K_M")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--bound", action="append", default=[], metavar="TYPE=RMS",
                    help="another gate bound for a type (export.max_logit_rms), e.g. q4_K_M=0.7")
    a = ap.parse_args()
    bounds = {k: float(v) for k, v in (b.split("=", 1) for b in a.bound)}
    with tempfile.TemporaryDirectory(prefix="baton-export-bench-") as tmp:
        work = Path(tmp)
        if a.ckpt is None:
            from outage_bench import hf_checkpoint

            src, name = hf_checkpoint(work), "tiny"
        else:
            src, name = a.ckpt.resolve(), a.ckpt.name
        (work / "serve").mkdir()
        hf = round(hf_tokens_per_s(src), 1)
        print(f"{name}: HF generate (fp32) {hf} tok/s", flush=True)
        rows = {}
        for type_name in a.types.split(","):
            (work / f"serve-{type_name}").mkdir()
            rows[type_name] = row = one_type(src, work, type_name, bounds.get(type_name))
            if type_name in bounds:
                row["gate_bound"] = bounds[type_name]
            print(f"{type_name:7} {row.get('size_bytes', 0) / 1e6:8.2f} MB  {row.get('llamacpp_tokens_per_s', 0):8.1f} "
                  f"tok/s  rms {row.get('logit_rms', float('nan')):.3g}  argmax {row.get('argmax_agreement')}  "
                  f"gate {row['gate_passed']}  served {row.get('served_checks_passed')}", flush=True)
        source_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    result = {"model": name, "source_safetensors_bytes": source_bytes, "hf_generate_tokens_per_s": hf,
              "decode": f"{NEW_TOKENS} greedy tokens from {PROMPT!r}, EOS ignored", "machine": platform.machine(),
              "cores": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2), "types": rows,
              "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = a.out or RESULTS / f"export_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out}")
    if not all(r["gate_passed"] for r in rows.values()):  # a served check that fails is a finding, kept in the row
        raise SystemExit(1)


if __name__ == "__main__":
    main()
