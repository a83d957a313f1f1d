"""`baton serve` and `baton rollback`: a registered model or a folder served on its own; the champion moved back."""
from __future__ import annotations

import sys
from pathlib import Path


def cmd_serve(args) -> int:
    """Serve a registered model (name@champion, name/3) or a checkpoint folder on its own, outside a pipeline."""
    import datetime as _dt

    from flows.config import ConfigError, load
    from tasks import events, tracking
    from tasks.serve.task import serve
    from conversions.manifest import Format
    from tasks.stage import StageContext

    overrides = [f"serve.engine={args.engine}", *args.set] + ([f"serve.port={args.port}"] if args.port else [])
    try:
        cfg = load(args.config, overrides)
    except ConfigError as e:
        print(f"baton serve: {e}", file=sys.stderr)
        return 2
    from flows import checkpoint_refs

    try:
        found = checkpoint_refs.resolve(args.ref)
    except checkpoint_refs.CheckpointRefError as e:
        print(f"baton serve: {e}", file=sys.stderr)
        return 2
    path, registered = found.path, found.registered_model or cfg.tracking.registered_model
    work = tracking.baton_home() / "serve" / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    ctx = StageContext(stage="serve", run_id=work.name, run_dir=work, work_dir=work, model=cfg.model.model_dump(),
                       seed=cfg.seed, data_dir=Path(args.data_dir).resolve() if args.data_dir else None, input=path,
                       input_format=Format.HF_SAFETENSORS, runtimes=cfg.engine_runtimes(),
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
            c.log_batch(ctx.mlflow_run_id, metrics=[Metric(events.summary_name(k), float(v), now, 0)
                                                    for k, v in out.metrics.items()
                                                    if isinstance(v, (int, float))])
        tracking.end_run(c, ctx.mlflow_run_id, bool(out and out.gate["passed"]))
    from conversions import verify

    print(verify.format_report(out.gate))
    if out.extra.get("champion"):
        ch = out.extra["champion"]
        print(f"champion: {ch['name']} version {ch['version']}")
    if out.extra.get("engine_exit"):
        print(f"baton serve: the engine died while serving (exit {out.extra['engine_exit']})", file=sys.stderr)
        return 3
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


def add_parsers(sub) -> None:
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
