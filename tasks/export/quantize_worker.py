"""Quantize one HF checkpoint for vLLM with llm-compressor (GPTQ, one shot) and write it as a compressed-tensors
folder. Runs in the llmcompressor runtime: `python quantize_worker.py --spec SPEC.json` (tasks.events.QuantizeSpec,
written by tasks.export.quantize).

The calibration rows are the first `calibration_rows` of the run's own pretraining text; the held-out loss is measured
on rows the calibration never saw, for the source and for the written folder read back from disk (decompressed by
compressed-tensors), so the gate judges the file, not the model left in memory. lm_head stays unquantized (vLLM's and
llm-compressor's usual recipe: the output projection is the most sensitive layer).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from importlib.metadata import version
from pathlib import Path

from tasks import events


def rows(path: Path, count: int) -> list[str]:
    texts = []
    with path.open() as f:
        for line in f:
            if len(texts) == count:
                break
            text = json.loads(line).get("text")
            if isinstance(text, str) and text:
                texts.append(text)
    if len(texts) < count:
        raise SystemExit(f"{path}: {len(texts)} text rows, {count} asked")
    return texts


def heldout_loss(model, tok, texts: list[str], max_len: int) -> float:
    """Mean token cross-entropy (nats) over every predicted token of the rows, one row at a time (no padding)."""
    import torch

    total, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=max_len)["input_ids"]
            if ids.shape[1] < 2:
                continue
            out = model(input_ids=ids, labels=ids)
            n = ids.shape[1] - 1
            total += float(out.loss) * n
            tokens += n
    return total / tokens


def weights_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def quantize(spec: events.QuantizeSpec, texts: list[str]) -> str:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(spec.src))
    model = AutoModelForCausalLM.from_pretrained(str(spec.src), dtype="auto")
    calib = Dataset.from_dict(dict(tok(texts, truncation=True, max_length=spec.max_seq_length)))
    recipe = GPTQModifier(targets="Linear", scheme=spec.scheme, ignore=["lm_head"])
    with contextlib.redirect_stdout(sys.stderr):  # llm-compressor's chatter is a log; stdout carries events
        oneshot(model=model, dataset=calib, recipe=recipe, max_seq_length=spec.max_seq_length,
                num_calibration_samples=len(texts))
        model.save_pretrained(str(spec.out), save_compressed=True)
        tok.save_pretrained(str(spec.out))
    return (f"llmcompressor {version('llmcompressor')} (compressed-tensors {version('compressed-tensors')}): "
            f"GPTQModifier {spec.scheme}, ignore lm_head")


def loaded(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = json.loads((folder / "config.json").read_text())
    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} \
        if "quantization_config" in config else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto", **kwargs), \
        AutoTokenizer.from_pretrained(str(folder))


def quantized_modules(folder: Path) -> int:
    """How many Linear layers of the written folder carry quantized weights (a `weight_scale` each)."""
    from safetensors import safe_open

    count = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            count += sum(1 for k in st.keys() if k.endswith(".weight_scale"))
    return count


def main() -> None:
    spec = events.read_typed_spec(events.QuantizeSpec)
    spec.out.mkdir(parents=True, exist_ok=True)
    calibration = rows(spec.calibration, spec.calibration_rows)
    heldout = rows(spec.heldout, spec.heldout_rows)
    model, tok = loaded(spec.src)
    before = heldout_loss(model, tok, heldout, spec.max_seq_length)
    del model
    t0 = time.time()
    quantizer = quantize(spec, calibration)
    seconds = round(time.time() - t0, 3)
    model, tok = loaded(spec.out)
    after = heldout_loss(model, tok, heldout, spec.max_seq_length)
    if not (math.isfinite(before) and math.isfinite(after)):
        raise SystemExit(f"held-out loss not finite: source {before}, quantized {after}")
    events.result(events.QuantizeResult(
        seconds=seconds, size=weights_size(spec.out), source_size=weights_size(spec.src), quantizer=quantizer,
        calibration_sha256=hashlib.sha256("\n".join(calibration).encode()).hexdigest(),
        heldout_loss_source=before, heldout_loss=after,  # unrounded: w8a8 moves a random-init model's loss by ~1e-5
        quantized_modules=quantized_modules(spec.out)))


if __name__ == "__main__":
    with events.causes_announced():
        main()
