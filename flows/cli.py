"""`baton`: run pipelines, verify and describe checkpoints, list runs.

Config errors are reported before Prefect, MLflow or any engine is imported, so they come back in about a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


# Offline, no telemetry, and time enough for Prefect's ephemeral server to migrate its database on 2 cores.
QUIET_ENV = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _env_defaults() -> None:
    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    home = Path(os.environ.setdefault("BATON_HOME", str(Path(".baton").resolve())))
    os.environ["BATON_HOME"] = str(home.resolve())
    stack = home / "stack.env"  # written by `make up`: use the running Prefect and MLflow servers
    if stack.exists():
        for line in stack.read_text().splitlines():
            if "=" in line and not line.startswith("#"):
                k, v = line.split("=", 1)
                os.environ.setdefault(k.strip(), v.strip())


def cmd_run(args) -> int:
    from flows.config import ConfigError, load

    try:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        cfg = load(args.config, args.set, stages)
        from flows.pipeline import pipeline, prepare

        prepare(cfg, args.from_ref)  # input checks before any flow run is created
    except ConfigError as e:
        print(f"baton: {e}", file=sys.stderr)
        return 2
    try:
        summary = pipeline(cfg, from_ref=args.from_ref, use_cache=not args.no_cache)
    except Exception as e:
        print(f"baton: {e}", file=sys.stderr)
        from flows.runs import list_runs

        latest = list_runs(1)
        if latest:
            print(latest[0]["run_dir"])
        return 1
    for s in summary["stages"]:
        print(f"  {s['label']:<28} {s['status']}")
    print(summary["run_dir"])
    return 0


def _planned_input(cfg, from_ref: str | None) -> tuple[str | None, str | None, str]:
    """(format, fingerprint, description) of the first stage's input, without starting anything."""
    from conversions import manifest as mf
    from flows import plan as planning
    from flows.config import ConfigError

    if from_ref and not from_ref.startswith("hf:") and Path(from_ref).is_dir():
        m = mf.read(Path(from_ref))
        if m is None:
            raise ConfigError(f"--from {from_ref}: no {mf.MANIFEST_NAME}; write one first with `baton manifest {from_ref}`")
        return m["format"], mf.digest_of(m), f"{Path(from_ref).resolve()} ({m['format']})"
    if from_ref:
        from flows.pipeline import resolve_input

        _, fmt, fp = resolve_input(cfg, from_ref)
        return fmt, fp, f"{from_ref} ({fmt})"
    prev = planning.predecessor(cfg)
    if prev is None:
        return None, None, "none (the first stage starts from scratch)"
    return prev.produces, prev.fingerprint, f"the completed '{prev.label}' of an earlier run with this config"


def cmd_config(args) -> int:
    """The resolved config and the planned steps (formats, fingerprints, cached or not); launches nothing."""
    import yaml

    from flows import plan as planning
    from flows.config import ConfigError, load
    from flows.runs import Index

    try:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        cfg = load(args.config, args.set, stages)
        fmt, fp, described = _planned_input(cfg, args.from_ref)
        steps = planning.plan(cfg, fmt, fp)
    except ConfigError as e:
        print(f"baton: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"config": cfg.model_dump(mode="json"), "input": described,
                          "steps": [s.to_dict() for s in steps]}, indent=2))
        return 0
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    print(f"\n# input: {described}\n# planned steps:")
    index = Index()
    for st in steps:
        rec = index.get(st.fingerprint) or {}
        state = "cached" if rec.get("status") == "completed" else "to run"
        formats = f"{st.consumes or '-'} -> {st.produces or '-'}"
        print(f"#   {st.label:<28} {formats:<38} {st.fingerprint[:12]}  {state}")
    return 0


def cmd_verify(args) -> int:
    from conversions import verify

    path = Path(args.path)
    if not path.exists():
        print(f"baton verify: {path}: no such folder", file=sys.stderr)
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

    path = Path(args.path)
    if not path.is_dir():
        print(f"baton manifest: {path}: no such folder", file=sys.stderr)
        return 2
    fmt = args.format or ("hf-safetensors" if (path / "config.json").exists() else None)
    if fmt is None:
        print("baton manifest: cannot tell the format; pass --format", file=sys.stderr)
        return 2
    if fmt == "hf-safetensors" and (path / "config.json").exists():
        from flows.hub import hf_manifest

        m = hf_manifest(path, stage=args.stage)
    else:
        m = mf.build(path, format=fmt, stage=args.stage, engine={"name": "external"}, tokenizer_dir=path / "tokenizer")
    out = mf.write(path, m)
    print(f"{out}: {len(m['files'])} files, {m['parameter_count']} parameters, format {fmt}")
    return 0


def cmd_convert(args) -> int:
    """Convert outside a pipeline, through the same worker and gate as the pipeline's convert step."""
    import subprocess

    from conversions import manifest as mf, verify
    from tasks.convert.task import WORKER, gate

    src, dst = Path(args.src).resolve(), Path(args.dst).resolve()
    if not (src / mf.MANIFEST_NAME).exists() and not args.from_format:
        print(f"baton convert: {src} has no manifest; pass --from-format", file=sys.stderr)
        return 2
    if dst.exists() and any(dst.iterdir()):
        print(f"baton convert: {dst} exists and is not empty (nothing is overwritten)", file=sys.stderr)
        return 2
    cmd = [sys.executable, str(WORKER), str(src), str(dst), "--to", args.to]
    if args.from_format:
        cmd += ["--from-format", args.from_format]
    rc = subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    if rc != 0:
        return rc
    rep = gate(dst, src, args.to)
    print(verify.format_report(rep))
    return 0 if rep["passed"] else 1


def cmd_runs(args) -> int:
    from flows.runs import list_runs

    rows = list_runs(args.limit)
    if not rows:
        print("no runs yet")
        return 0
    for r in rows:
        stages = " ".join(f"{s['label']}:{s['status']}" for s in r.get("stages", []))
        print(f"{r['run_id']}  {r.get('status', '?'):<9}  {stages}")
    return 0


def cmd_serve(args) -> int:
    """Serve a registered model (name@champion, name/3) or a checkpoint folder on its own, outside a pipeline."""
    import datetime as _dt

    from flows.config import ConfigError, load
    from tasks import tracking
    from tasks.serve.task import serve
    from tasks.stage import StageContext

    overrides = [f"serve.engine={args.engine}", *args.set] + ([f"serve.port={args.port}"] if args.port else [])
    try:
        cfg = load(args.config, overrides)
    except ConfigError as e:
        print(f"baton serve: {e}", file=sys.stderr)
        return 2
    registered = cfg.tracking.registered_model
    if Path(args.ref).exists():
        path = Path(args.ref).resolve()
    else:
        try:
            path, registered, _ = tracking.resolve_model_ref(args.ref)
        except Exception as e:
            print(f"baton serve: {args.ref}: neither a folder nor a registered model (name@alias, name/version): {e}",
                  file=sys.stderr)
            return 2
    work = tracking.baton_home() / "serve" / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    ctx = StageContext(stage="serve", run_id=work.name, run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=cfg.seed, data_dir=Path(args.data_dir).resolve() if args.data_dir else None, input=path,
                       input_format="hf-safetensors", runtimes={k: v.model_dump() for k, v in cfg.runtimes.items()},
                       tracking={**cfg.tracking.model_dump(), "registered_model": registered})
    serve_cfg = cfg.serve.model_copy(update={"promote": args.promote,
                                             "lm_eval": cfg.serve.lm_eval.model_copy(update={"enabled": args.eval})})
    c = tracking.client()  # its own MLflow run: the gate and metrics are kept, and registering needs a run
    ctx.mlflow_run_id = tracking.start_run(c, cfg.tracking.experiment, f"serve-{work.name}",
                                           tags={"baton.stage": "serve", "baton.serve_ref": args.ref})
    out = None
    try:
        out = serve(ctx, serve_cfg, hold=not args.check_only)
    finally:
        if out is not None:
            tracking.log_json(c, ctx.mlflow_run_id, out.gate, "gate.json")
            from mlflow.entities import Metric

            import time as _time

            now = int(_time.time() * 1000)
            c.log_batch(ctx.mlflow_run_id, metrics=[Metric(k, float(v), now, 0) for k, v in out.metrics.items()
                                                    if isinstance(v, (int, float))])
        tracking.end_run(c, ctx.mlflow_run_id, bool(out and out.gate["passed"]))
    from conversions import verify

    print(verify.format_report(out.gate))
    if out.extra.get("champion"):
        ch = out.extra["champion"]
        print(f"champion: {ch['name']} version {ch['version']}")
    return 0 if out.gate["passed"] else 1


def cmd_rollback(args) -> int:
    from tasks import tracking

    try:
        res = tracking.rollback_champion(tracking.client(), args.name)
    except Exception as e:
        print(f"baton rollback: {e}", file=sys.stderr)
        return 1
    print(f"{res['name']}: champion moved back from version {res['from']} to version {res['to']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a pipeline config")
    r.add_argument("config")
    r.add_argument("--stages", help="comma-separated ordered subset, e.g. data,pretrain,convert")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.add_argument("--from", dest="from_ref", help="input checkpoint folder, registered model name@alias, or hf:ORG/NAME[@REVISION]")
    r.add_argument("--no-cache", action="store_true", help="re-run stages even when inputs and config are unchanged")
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser("config", help="print the resolved config and the planned steps; launch nothing (dry run)")
    c.add_argument("config")
    c.add_argument("--stages", help="comma-separated ordered subset, e.g. data,pretrain,convert")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    c.add_argument("--from", dest="from_ref", help="input checkpoint folder, registered model name@alias, or hf:ORG/NAME[@REVISION]")
    c.add_argument("--json", action="store_true", help="machine-readable: config, input and steps")
    c.set_defaults(fn=cmd_config)
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
    cv = sub.add_parser("convert", help="convert a checkpoint (e.g. megatron-dist → hf-safetensors)")
    cv.add_argument("src")
    cv.add_argument("dst")
    cv.add_argument("--to", default="hf-safetensors")
    cv.add_argument("--from-format")
    cv.set_defaults(fn=cmd_convert)
    ls = sub.add_parser("runs", help="list recent runs")
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(fn=cmd_runs)
    sv = sub.add_parser("serve", help="serve name@champion or a checkpoint folder (vLLM or SGLang) until Ctrl-C")
    sv.add_argument("ref", help="checkpoint folder, name@alias or name/version")
    sv.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    sv.add_argument("--port", type=int, default=0)
    sv.add_argument("--config", default=None, help="YAML whose serve/tracking/runtimes sections apply")
    sv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. serve.precision=bf16")
    sv.add_argument("--data-dir", help="data stage output: enables the held-out lm-eval task")
    sv.add_argument("--eval", action="store_true", help="run lm-eval against the server before serving")
    sv.add_argument("--promote", action="store_true", help="move `champion` here when every check passes")
    sv.add_argument("--check-only", action="store_true", help="run the smoke checks, then stop the server")
    sv.set_defaults(fn=cmd_serve)
    rb = sub.add_parser("rollback", help="move the `champion` alias back to the version it replaced")
    rb.add_argument("name", help="registered model name")
    rb.set_defaults(fn=cmd_rollback)
    return ap


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
