"""Convert a checkpoint to another format, write its manifest. Runs in the main runtime: `python worker.py --spec
SPEC.json` (tasks.convert.task.worker_spec: every value from ConvertConfig, none defaulted here)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from conversions import hf, manifest as mf, registry, sealed, zero
from conversions.manifest import Format
from tasks import events


def refuse_unsealed(src: Path, fmt: str) -> None:
    """A training stage's checkpoint is converted only if its seal's HMAC and every digest verify, before any loader
    reads a byte of it (whoever can write the folder could otherwise swap the files and their sha256 together)."""
    folder = src / zero.resolve_tag(src) if fmt == Format.DEEPSPEED_ZERO else src
    why = sealed.problem(folder, sealed.MARKERS[fmt])
    if why:
        raise SystemExit(f"{folder}: {why}; not converting it")


def main() -> None:
    spec = events.read_typed_spec(events.ConvertSpec)
    src, dst, to_format = spec.src, spec.dst, spec.to_format
    src_m = mf.read(src)
    src_format = spec.from_format or (src_m or {}).get("format")
    if not src_format:
        raise SystemExit(f"{src}: no manifest, pass --from-format")
    fn = registry.converter(src_format, to_format)
    if spec.require_seal:
        refuse_unsealed(src, src_format)
    t0 = time.time()
    dst.mkdir(parents=True, exist_ok=True)
    info = fn(src, dst, max_shard_bytes=spec.max_shard_size_mb << 20) or {}
    seconds = time.time() - t0
    if to_format in sealed.MARKERS:  # baton wrote it, so a training stage may load it as it is (pretrain: from HF)
        sealed.seal(dst, sealed.MARKERS[to_format], converted_from=str(src))
    write_manifest(src, dst, src_m, src_format, to_format, spec.stage, seconds, info)
    events.emit("result", **events.ConvertResult(seconds=seconds, from_format=src_format, to_format=to_format,
                                                 info=json.loads(json.dumps(info, default=str))).model_dump())


def write_manifest(src: Path, dst: Path, src_m: dict | None, src_format: str, to_format: str, stage: str,
                   seconds: float, info: dict) -> None:
    to_hf = to_format == Format.HF_SAFETENSORS
    m = mf.build(
        dst, format=to_format, stage=stage, architecture=dict((src_m or {}).get("architecture") or {}),
        engine={"name": "baton-convert", "converter": registry.CONVERTERS[(src_format, to_format)],
                **mf.engine_versions("torch", "safetensors", "transformers")},
        parameter_count=hf.parameter_count(dst) if to_hf else info.get("parameter_count"),
        dtype=hf.dominant_dtype(dst) if to_hf else info.get("dtype"),
        parent=mf.parent_ref(src),
        extra={"from_format": src_format, "seconds": round(seconds, 3), **info},
        tokenizer_dir=dst if to_hf else dst / "tokenizer",
    )
    mf.write(dst, m)


if __name__ == "__main__":
    with events.causes_announced():
        main()
