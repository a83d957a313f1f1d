"""Fixed probe inputs and logits, shared by every parity check (L2) so that two stages compare like with like."""
from __future__ import annotations

from pathlib import Path

PROBE_FILE = "probe_logits.safetensors"

# The config vocabulary's `precision` values and the torch dtype names that weights are kept in.
DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# Tolerances for logits parity, by the dtype the weights are kept in. `per_logit_scale`: float32 rounding grows with
# the logits' magnitude (the same weights summed in another order, e.g. by another thread count, differ by a few ulps
# of the largest logit), so the limit is max_abs_diff + per_logit_scale × max |reference logit|. 1e-5 is ~84 ulps:
# Gemma 3's logits reach 174 and differ by 2.3e-4 between 1 and 2 threads; a weight rounded to bf16 moves them ~1e-2.
THRESHOLDS = {
    "float32": {"max_abs_diff": 1e-4, "per_logit_scale": 1e-5, "top1_agreement": 1.0},
    # Half precision: the probe has 32 positions, so 0.98 allowed no flip at all; a near tie (top-2 logits closer than
    # bf16's rounding of them) flips between two correct implementations (the first bf16 pretrain → HF parity:
    # max |Δlogit| 0.044, one position of 32 flipped). The max |Δlogit| bound stays the strict check.
    "bfloat16": {"max_abs_diff": 0.25, "top1_agreement": 0.9},
    "float16": {"max_abs_diff": 0.05, "top1_agreement": 0.9},
}


def probe_input_ids(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 1234):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def hf_logits(model_dir: Path, input_ids, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def save_reference(path: Path, input_ids, logits, source: str) -> Path:
    """Logits of the engine's in-memory model on the probe inputs, written beside its checkpoint."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_dir():
        path = path / PROBE_FILE
    save_file({"input_ids": input_ids.contiguous(), "logits": logits.float().contiguous()}, str(path),
              metadata={"format": "pt", "source": source})
    return path


def load_reference(path: Path):
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        path = path / PROBE_FILE
    t = load_file(str(path))
    return t["input_ids"], t["logits"]


def compare_logits(a, b, dtype: str = "float32") -> dict:
    """max abs diff and top-1 agreement of two logits tensors, with the pass/fail verdict for dtype."""
    if a.shape != b.shape:
        return {"passed": False, "detail": f"logits shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"}
    diff = (a.float() - b.float()).abs().max().item()
    top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    lim = THRESHOLDS.get(dtype, THRESHOLDS["float32"])
    scale = b.float().abs().max().item()
    limit = lim["max_abs_diff"] + lim.get("per_logit_scale", 0.0) * scale
    passed = diff <= limit and top1 >= lim["top1_agreement"]
    bound = f"{limit:.3g}" + (f" = {lim['max_abs_diff']:g} + {lim['per_logit_scale']:g} × max |logit| {scale:.3g}"
                              if lim.get("per_logit_scale") else "")
    return {"passed": passed, "max_abs_diff": diff, "top1_agreement": top1,
            "detail": f"max |Δlogit| {diff:.3g} (≤ {bound}), top-1 agreement {top1:.3f} "
                      f"(≥ {lim['top1_agreement']:g}) [{dtype}]"}
