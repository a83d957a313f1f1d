"""Which converter turns one checkpoint format into another. Each entry is "module:function" with the signature

    convert(src: Path, dst: Path, *, max_shard_bytes: int) -> dict   # returns facts for the manifest's `extra`

A converter writes an HF folder complete with config.json, safetensors (format=pt), tokenizer and chat template.
Non-HF checkpoints keep their tokenizer in `<checkpoint>/tokenizer/`; engines write the logits of their in-memory
model on the probe inputs to `<checkpoint>/probe_logits.safetensors`, which the conversion gate compares against.
"""
from __future__ import annotations

import importlib

from conversions.manifest import Format

CONVERTERS: dict[tuple[str, str], str] = {
    (Format.MEGATRON_DIST, Format.HF_SAFETENSORS): "conversions.megatron:to_hf",
    (Format.HF_SAFETENSORS, Format.MEGATRON_DIST): "conversions.megatron:from_hf",
    (Format.DEEPSPEED_ZERO, Format.HF_SAFETENSORS): "conversions.zero:to_hf",
}


class NoConverter(LookupError):
    pass


def converter(src_format: str, dst_format: str):
    key = (src_format, dst_format)
    if key not in CONVERTERS:
        known = ", ".join(f"{a}→{b}" for a, b in CONVERTERS)
        raise NoConverter(f"no converter from {src_format} to {dst_format} (known: {known})")
    mod, fn = CONVERTERS[key].split(":")
    return getattr(importlib.import_module(mod), fn)


def supported(src_format: str, dst_format: str) -> bool:
    return (src_format, dst_format) in CONVERTERS
