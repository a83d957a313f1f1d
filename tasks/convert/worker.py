"""Convert a checkpoint to another format, write its manifest. Runs in the main runtime: `python worker.py SRC DST FMT`."""
from __future__ import annotations

import argparse
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
    ap = argparse.ArgumentParser()
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--to", default=Format.HF_SAFETENSORS)
    ap.add_argument("--from-format", default=None)
    ap.add_argument("--max-shard-mb", type=int, default=2048)
    ap.add_argument("--stage", default="convert")
    ap.add_argument("--require-seal", action="store_true", help="refuse SRC unless its seal verifies (the pipeline)")
    args = ap.parse_args()
    src_m = mf.read(args.src)
    src_format = args.from_format or (src_m or {}).get("format")
    if not src_format:
        raise SystemExit(f"{args.src}: no manifest, pass --from-format")
    fn = registry.converter(src_format, args.to)
    if args.require_seal:
        refuse_unsealed(args.src, src_format)
    t0 = time.time()
    args.dst.mkdir(parents=True, exist_ok=True)
    info = fn(args.src, args.dst, max_shard_bytes=args.max_shard_mb << 20) or {}
    seconds = time.time() - t0
    if args.to in sealed.MARKERS:  # baton wrote it, so a training stage may load it as it is (pretrain: from HF)
        sealed.seal(args.dst, sealed.MARKERS[args.to], converted_from=str(args.src))
    arch = dict((src_m or {}).get("architecture") or {})
    to_hf = args.to == Format.HF_SAFETENSORS
    m = mf.build(
        args.dst, format=args.to, stage=args.stage, architecture=arch,
        engine={"name": "baton-convert", "converter": registry.CONVERTERS[(src_format, args.to)],
                **mf.engine_versions("torch", "safetensors", "transformers")},
        parameter_count=hf.parameter_count(args.dst) if to_hf else info.get("parameter_count"),
        dtype=hf.dominant_dtype(args.dst) if to_hf else info.get("dtype"),
        parent=mf.parent_ref(args.src),
        extra={"from_format": src_format, "seconds": round(seconds, 3), **info},
        tokenizer_dir=args.dst if to_hf else args.dst / "tokenizer",
    )
    mf.write(args.dst, m)
    events.emit("result", seconds=seconds, from_format=src_format, to_format=args.to, info=json.loads(json.dumps(info, default=str)))


if __name__ == "__main__":
    with events.causes_announced():
        main()
