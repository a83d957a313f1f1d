"""`baton verify`, `manifest`, `convert` and `lineage`: checkpoints outside a pipeline."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _checkpoint(command: str, ref: str) -> Path | None:
    """The folder a checkpoint reference names (flows/checkpoint_refs.py), or None after saying why."""
    from flows import checkpoint_refs

    try:
        return checkpoint_refs.resolve(ref).path
    except checkpoint_refs.CheckpointRefError as e:
        print(f"baton {command}: {e}", file=sys.stderr)
        return None


def cmd_verify(args) -> int:
    from conversions import verify

    path = _checkpoint("verify", args.path)
    if path is None:
        return 2
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # libraries print banners; stdout carries only the report
        rep = verify.verify(path, Path(args.against) if args.against else None)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print(verify.format_report(rep))
    return 0 if rep["passed"] else 1


def cmd_manifest(args) -> int:
    from conversions import manifest as mf
    from conversions.manifest import Format

    path = _checkpoint("manifest", args.path)
    if path is None:
        return 2
    fmt = args.format or (Format.HF_SAFETENSORS if (path / "config.json").exists() else None)
    if fmt is None:
        print("baton manifest: cannot tell the format; pass --format", file=sys.stderr)
        return 2
    try:
        if fmt == Format.HF_SAFETENSORS and (path / "config.json").exists():
            from flows.hub import hf_manifest

            m = hf_manifest(path, stage=args.stage)
        else:
            m = mf.build(path, format=fmt, stage=args.stage, engine={"name": "external"},
                         tokenizer_dir=path / "tokenizer")
    except mf.ManifestError as e:  # e.g. a symlink or FIFO in the folder: named, nothing written
        print(f"baton manifest: {e}", file=sys.stderr)
        return 2
    out = mf.write(path, m)
    print(f"{out}: {len(m['files'])} files, {m['parameter_count']} parameters, format {fmt}")
    return 0


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".distcp", ".bin")


def cmd_convert(args) -> int:
    """Convert outside a pipeline, through the same worker and gate as the pipeline's convert step."""
    import shutil
    import subprocess
    import tempfile

    from conversions import durable, folder, manifest as mf, verify
    from tasks import events
    from tasks.convert.config import ConvertConfig
    from tasks.convert.task import WORKER, gate, worker_spec
    from tasks.stage import REPO_ROOT

    src, dst = _checkpoint("convert", args.src), Path(args.dst).resolve()
    if src is None:
        return 2
    if not (src / mf.MANIFEST_NAME).exists() and not args.from_format:
        print(f"baton convert: {src} has no manifest; pass --from-format", file=sys.stderr)
        return 2
    if dst.exists() and any(dst.iterdir()):
        print(f"baton convert: {dst} exists and is not empty (nothing is overwritten)", file=sys.stderr)
        return 2
    if unsafe := folder.unsafe_entries(src):  # before any reader could follow a link out of the folder
        print(f"baton convert: {src}: {'; '.join(unsafe[:5])}; nothing written", file=sys.stderr)
        return 2
    partial = durable.partial_of(dst)
    shutil.rmtree(partial, ignore_errors=True)  # a crashed earlier attempt's leftovers: never published
    needed = sum(f.stat().st_size for f in src.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    if problem := durable.free_space_problem(dst.parent, needed):
        print(f"baton convert: {problem}; nothing written", file=sys.stderr)
        return 2
    cfg = ConvertConfig(**({"to_format": args.to} if args.to else {}))
    with tempfile.TemporaryDirectory(prefix="baton-convert-") as scratch:
        spec = events.write_spec(Path(scratch) / "convert_spec.json",
                                 worker_spec(src, partial, cfg, "convert", args.from_format))
        rc = subprocess.call([sys.executable, str(WORKER), "--spec", str(spec)],
                             env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    if rc != 0:
        full = shutil.disk_usage(dst.parent).free < (1 << 20)
        shutil.rmtree(partial, ignore_errors=True)  # never published; free what it took
        print(f"baton convert: the conversion failed (exit {rc}){'; no space left on device: ' if full else ''}"
              f"{durable.describe_disk(dst.parent) if full else ''}; {dst} was not written", file=sys.stderr)
        return rc
    rep = gate(partial, src, cfg.to_format)
    print(verify.format_report(rep))
    if not rep["passed"]:
        print(f"baton convert: the gate failed; {dst} was not written (the output is kept in {partial} to inspect)",
              file=sys.stderr)
        return 1
    if dst.exists():
        dst.rmdir()  # empty, checked above
    durable.publish_dir(partial, dst)
    return 0


def cmd_lineage(args) -> int:
    """The chain from the data digest through every stage and conversion to REF (and its serving)."""
    from flows import lineage

    try:
        path, what = lineage.resolve(args.ref)
        nodes = lineage.chain(path)
    except lineage.LineageError as e:
        print(f"baton lineage: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([n.to_dict() for n in nodes], indent=2))
    elif args.mermaid:
        print(lineage.mermaid(nodes))
    else:
        print(lineage.text(nodes, what))
    return 0


def add_parsers(sub) -> None:
    from conversions.manifest import Format

    v = sub.add_parser("verify", help="verify a checkpoint (integrity, preflight, round trip, generation)")
    v.add_argument("path")
    v.add_argument("--against", help="another HF checkpoint or a probe_logits.safetensors for logits parity")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=cmd_verify)
    m = sub.add_parser("manifest", help="write the manifest for an existing checkpoint")
    m.add_argument("path")
    m.add_argument("--format")
    m.add_argument("--stage", default=None)
    m.set_defaults(fn=cmd_manifest)
    cv = sub.add_parser("convert",
                        help=f"convert a checkpoint (e.g. {Format.MEGATRON_DIST} → {Format.HF_SAFETENSORS})")
    cv.add_argument("src")
    cv.add_argument("dst")
    cv.add_argument("--to", help="the format to write (default: the convert config's to_format)")
    cv.add_argument("--from-format")
    cv.set_defaults(fn=cmd_convert)
    li = sub.add_parser("lineage", help="where a checkpoint came from: data digest → every step → serving")
    li.add_argument("ref", help="name@alias, name/version, a run id or a checkpoint folder")
    li.add_argument("--json", action="store_true")
    li.add_argument("--mermaid", action="store_true", help="the chain as a Mermaid flowchart")
    li.set_defaults(fn=cmd_lineage)
