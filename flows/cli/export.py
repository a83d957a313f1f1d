"""`baton export`: a GGUF file for llama.cpp / Ollama / LM Studio from an HF checkpoint, published only when its gate
passed (docs/export.md)."""
from __future__ import annotations

import sys
from pathlib import Path


def cmd_export(args) -> int:
    from conversions import folder, gguf_export, verify
    from flows.cli.checkpoint import _checkpoint
    from tasks.export import run

    src, dest = _checkpoint("export", args.src), Path(args.dest).resolve()
    if src is None:
        return 2
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        print(f"baton export: {dest} exists and is not empty (nothing is overwritten)", file=sys.stderr)
        return 2
    if unsafe := folder.unsafe_entries(src):
        print(f"baton export: {src}: {'; '.join(unsafe[:5])}; nothing written", file=sys.stderr)
        return 2
    gguf_export.export_type(args.type)  # a Refused (unknown type, not HF) is main's one line, before any write
    run.refuse_source(src)
    if dest.exists():
        dest.rmdir()  # empty, checked above
    outcome = run.export(src, dest, args.type, args.max_logit_rms)
    if outcome.detail:
        print(f"baton export: {outcome.detail}; {dest} was not written", file=sys.stderr)
        return 1
    print(verify.format_report(outcome.report))
    if outcome.published is None:
        print(f"baton export: the gate failed; {dest} was not written (the output is kept in {outcome.kept} to "
              f"inspect)", file=sys.stderr)
        return 1
    print(f"{dest / 'model.gguf'}: {args.type}")
    return 0


def add_parsers(sub) -> None:
    from conversions.gguf_export import TYPES

    ex = sub.add_parser("export", help="export an HF checkpoint to GGUF (llama.cpp), gated against the source")
    ex.add_argument("src", help="an HF checkpoint: a folder, name@alias, name/version or a run id")
    ex.add_argument("dest", help="the folder to write: model.gguf and its manifest")
    ex.add_argument("--type", default="f16", help=f"the GGUF type: {', '.join(TYPES)} (f16 and q8_0 from llama.cpp's "
                                                  "converter, the others by llama-quantize from its f16)")
    ex.add_argument("--max-logit-rms", type=float, default=None,
                    help="the gate's bound on the rms logit difference, in units of the source logits' std "
                         "(default: the type's, docs/export.md)")
    ex.set_defaults(fn=cmd_export)
