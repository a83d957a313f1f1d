"""`baton import gguf:PATH DEST`: a model from another format made into a checkpoint folder with its manifest."""
from __future__ import annotations

import sys
from pathlib import Path


def cmd_import(args) -> int:
    import time

    from conversions import gguf
    from flows import gguf_import

    started = time.monotonic()
    try:
        src = gguf_import.source_path(args.source)
        m = gguf_import.import_gguf(src, Path(args.dest))
    except (gguf.GGUFError, OSError) as e:
        print(f"baton import: {e}", file=sys.stderr)
        return 2
    source, serving = m["extra"]["source"], m["serving"]
    print(f"{Path(args.dest).resolve()}: {m['parameter_count']} parameters ({m['dtype']}) from {source['path']} "
          f"(sha256 {source['sha256'][:16]}…, {source['metadata'].get('file_type_name', 'GGUF')}); "
          f"bos/eos/pad ids {serving['token_ids']}; chat template "
          f"{'yes' if m['tokenizer']['chat_template'] else 'none'}; {time.monotonic() - started:.1f} s")
    return 0


def add_parsers(sub) -> None:
    im = sub.add_parser("import", help="import a GGUF file as an HF safetensors checkpoint (dequantised, fp32)")
    im.add_argument("source", help="gguf:PATH (a llama.cpp GGUF file)")
    im.add_argument("dest", help="the checkpoint folder to write (must not exist)")
    im.set_defaults(fn=cmd_import)
