"""`baton export`: a GGUF file for llama.cpp / Ollama / LM Studio, or a quantized checkpoint for vLLM, from an HF
checkpoint, published only when its gate passed (docs/export.md)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def cmd_export(args) -> int:
    from conversions import folder, gguf_export, verify, vllm_quant
    from flows.cli.checkpoint import _checkpoint
    from tasks.export import quantize, run
    from tasks.export.config import is_quantization

    src, dest = _checkpoint("export", args.src), Path(args.dest).resolve()
    if src is None:
        return 2
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        print(f"baton export: {dest} exists and is not empty (nothing is overwritten)", file=sys.stderr)
        return 2
    if unsafe := folder.unsafe_entries(src):
        print(f"baton export: {src}: {'; '.join(unsafe[:5])}; nothing written", file=sys.stderr)
        return 2
    quantized = is_quantization(args.type)
    if quantized and args.calibration_rows < 1:
        print(f"baton export: --calibration-rows {args.calibration_rows}: must be at least 1", file=sys.stderr)
        return 2
    if quantized:  # a Refused (unknown type, not HF, no data) is main's one line, before any write
        quantize.data_files(Path(args.calibration).resolve() if args.calibration else None)
    else:
        gguf_export.export_type(args.type)
    run.refuse_source(src)
    if quantized:
        vllm_quant.refuse_shapes(args.type, json.loads((src / "config.json").read_text()))
    if dest.exists():
        dest.rmdir()  # empty, checked above
    if quantized:
        outcome = quantize.export(src, dest, args.type, Path(args.calibration).resolve(), args.max_loss_delta,
                                  rows=args.calibration_rows)
    else:
        outcome = run.export(src, dest, args.type, args.max_logit_rms)
    if outcome.detail:
        print(f"baton export: {outcome.detail}; {dest} was not written", file=sys.stderr)
        return 1
    print(verify.format_report(outcome.report))
    if outcome.published is None:
        print(f"baton export: the gate failed; {dest} was not written (the output is kept in {outcome.kept} to "
              f"inspect)", file=sys.stderr)
        return 1
    print(f"{dest if quantized else dest / 'model.gguf'}: {args.type}")
    return 0


def add_parsers(sub) -> None:
    from conversions import vllm_quant
    from conversions.gguf_export import TYPES

    ex = sub.add_parser("export", help="export an HF checkpoint to GGUF (llama.cpp) or quantize it for vLLM, gated "
                                       "against the source")
    ex.add_argument("src", help="an HF checkpoint: a folder, name@alias, name/version or a run id")
    ex.add_argument("dest", help="the folder to write: model.gguf (or the quantized checkpoint) and its manifest")
    ex.add_argument("--type", default="f16", help=f"the GGUF type: {', '.join(TYPES)} (f16 and q8_0 from llama.cpp's "
                                                  "converter, the others by llama-quantize from its f16); or a "
                                                  f"quantization for vLLM: {', '.join(vllm_quant.TYPES)} "
                                                  "(llm-compressor, compressed-tensors)")
    ex.add_argument("--calibration", default=None,
                    help="a quantization type's data: a data stage's output (.baton/runs/<run-id>/data); it calibrates "
                         "on its pretraining train split, the gate's held-out loss on its held-out split")
    ex.add_argument("--calibration-rows", type=int, default=vllm_quant.CALIBRATION_ROWS,
                    help="calibration rows (and as many held-out rows) of a quantization type")
    ex.add_argument("--max-loss-delta", type=float, default=None,
                    help="a quantization type's gate bound: the held-out loss's difference from the source's, nats per "
                         "token (default: the type's, docs/export.md)")
    ex.add_argument("--max-logit-rms", type=float, default=None,
                    help="the gate's bound on the rms logit difference, in units of the source logits' std "
                         "(default: the type's, docs/export.md)")
    ex.set_defaults(fn=cmd_export)
