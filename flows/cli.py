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
    if os.path.lexists(stack):
        from tasks import stack_env

        try:
            settings = stack_env.read(stack)
        except stack_env.StackEnvError as e:
            raise SystemExit(f"baton: {e}") from None
        for k, v in settings.items():
            os.environ.setdefault(k, v)


def _prepare_run(args):
    """(the config to run, the config as written, the planned steps); smoke size when --smoke. Raises ConfigError."""
    from flows.config import ConfigError, load

    stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
    full = cfg = load(args.config, args.set, stages)  # before Prefect is imported: config errors come back in ~1 s
    from flows import smoke
    from flows.pipeline import prepare

    if args.smoke:
        cfg = smoke.smoke_config(cfg)
    elif cfg.require_smoke and smoke.passing_smoke(cfg) is None:
        raise ConfigError(f"require_smoke: no passing smoke run of this config (fingerprint "
                          f"{smoke.fingerprint(cfg)[:12]}); run `baton run {args.config} --smoke` with the same "
                          "--set/--stages first")
    _, _, steps = prepare(cfg, args.from_ref)  # input checks before any flow run is created
    return cfg, full, steps


def _exit_on_sigterm() -> None:
    """A SIGTERM (`kill`, a stopping container) ends `baton run` through a normal exit, like Ctrl-C: the default action
    would skip the atexit hooks and leave Prefect's ephemeral server running. While the flow runs, Prefect's handler
    takes the signal first (the run is recorded as cancelled on the way out), then hands it on to this one."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def cmd_run(args) -> int:
    from flows.config import ConfigError
    from flows.playbook import preflight

    _exit_on_sigterm()
    try:
        cfg, full, steps = _prepare_run(args)
    except ConfigError as e:
        print(f"baton: {e}", file=sys.stderr)
        return 2
    if args.no_wait:  # read by each step as it takes its lock (also inside Prefect's task threads)
        os.environ["BATON_NO_WAIT"] = "1"
        if busy := _busy_step(steps):  # refused before anything is written: no run folder, no MLflow run
            print(f"baton: {busy}; not waiting (--no-wait)", file=sys.stderr)
            return 1
    ok, findings = preflight(cfg) if not args.no_doctor else (True, [])
    if not ok:
        print("baton: `baton doctor` found errors; nothing was launched (--no-doctor skips the checks)",
              file=sys.stderr)
        return 2
    from flows import runs, view as views
    from tasks import tracking

    run_id = runs.new_run_id()
    run_dir = runs.runs_root() / run_id
    out = sys.stdout if args.verbose else views.detach_process_output(run_dir / "run.log")
    server = _start_prefect_server()  # both start-ups overlap each other and the view (their logs go to run.log)
    tracking.warm_up()
    title = f"baton run {run_id} · {cfg.name}"
    view = views.open_view([s.label for s in steps], title, out, live=not args.verbose)
    try:
        error = _run_pipeline(cfg, args, run_id, findings, server)
    finally:  # Ctrl-C too: the terminal gets its cursor back
        views.close_view(view)
    if args.smoke and error is None:
        from flows import smoke

        out.write(f"smoke passed; recorded {smoke.record(full, json.loads((run_dir / 'summary.json').read_text()))}\n")
    return _report_run(out, run_dir, error)


def _busy_step(steps) -> str | None:
    from flows.runs import StepLock

    for step in steps:
        if (holder := StepLock(step.fingerprint, step.label).holder()) is not None:
            return f"step {step.label} is being run by {holder}"
    return None


def _start_prefect_server():
    """Without a running stack (no PREFECT_API_URL) the flow starts Prefect's temporary server (a subprocess, 5-30 s
    on 2 cores); started here in a thread instead, it boots while the rest gets ready. The flow's own start() then
    finds it running; a failure here is left for that call to report."""
    import threading

    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    from prefect.server.api.server import SubprocessASGIServer

    def start():
        try:
            SubprocessASGIServer().start()
        except Exception:  # noqa: BLE001 - the flow's own start() retries and reports
            pass

    thread = threading.Thread(target=start, name="prefect-server", daemon=True)
    thread.start()
    return thread


def _run_pipeline(cfg, args, run_id: str, findings: list, server=None) -> Exception | None:
    import prefect.flow_engine  # noqa: F401 - imported while the server boots, not after

    from flows.pipeline import pipeline

    if server is not None:
        server.join()  # start() marks the server running before it is healthy: the flow must not see it earlier
    try:
        pipeline(cfg, from_ref=args.from_ref, use_cache=not args.no_cache, run_id=run_id, doctor=findings)
    except Exception as e:
        return e
    return None


def _report_run(out, run_dir: Path, error: Exception | None) -> int:
    """The summary table, each failed step's cause and log tail, and the run folder (always the last line)."""
    from flows import view as views

    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"stages": []}
    lines = views.summary_lines(summary)
    failed = [s for s in summary["stages"] if s.get("status") == "failed"]
    for entry in failed:
        lines += [""] + views.failure_report(entry)
    if error is not None and not failed:
        lines += ["", f"baton: {str(error).splitlines()[0]}"]
    out.write("\n".join(lines + [str(run_dir)]) + "\n")
    out.flush()
    return 1 if error is not None else 0


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
    try:
        if fmt == "hf-safetensors" and (path / "config.json").exists():
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
    import subprocess

    import shutil

    from conversions import durable, folder, manifest as mf, verify
    from tasks.convert.task import WORKER, gate

    src, dst = Path(args.src).resolve(), Path(args.dst).resolve()
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
    cmd = [sys.executable, str(WORKER), str(src), str(partial), "--to", args.to]
    if args.from_format:
        cmd += ["--from-format", args.from_format]
    rc = subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    if rc != 0:
        full = shutil.disk_usage(dst.parent).free < (1 << 20)
        shutil.rmtree(partial, ignore_errors=True)  # never published; free what it took
        print(f"baton convert: the conversion failed (exit {rc}){'; no space left on device: ' if full else ''}"
              f"{durable.describe_disk(dst.parent) if full else ''}; {dst} was not written", file=sys.stderr)
        return rc
    rep = gate(partial, src, args.to)
    print(verify.format_report(rep))
    if not rep["passed"]:
        print(f"baton convert: the gate failed; {dst} was not written (the output is kept in {partial} to inspect)",
              file=sys.stderr)
        return 1
    if dst.exists():
        dst.rmdir()  # empty, checked above
    durable.publish_dir(partial, dst)
    return 0


def cmd_runs(args) -> int:
    """A table: run, config, each step's status, the champion marker, age."""
    from flows.runs import list_runs, runs_table

    rows = list_runs(args.limit)
    if not rows:
        print("no runs yet")
        return 0
    print(runs_table(rows, _champion_run_ids()))
    return 0


def _champion_run_ids() -> set[str]:
    """baton runs whose checkpoint is some registered model's `champion` (empty when MLflow has none)."""
    try:
        from tasks import tracking

        c = tracking.client()
        found = set()
        for rm in c.search_registered_models():
            if "champion" in (rm.aliases or {}):
                mv = c.get_model_version(rm.name, rm.aliases["champion"])
                found.add(mv.tags.get("baton.run_id", ""))
        return found - {""}
    except Exception:
        return set()


def cmd_show(args) -> int:
    """One run's summary (the content of its summary.md, without the embedded plots)."""
    from flows.runs import runs_root

    summary = runs_root() / args.run / "summary.md"
    if not summary.exists():
        print(f"baton show: no run {args.run!r} with a summary in {runs_root()}", file=sys.stderr)
        return 2
    text = summary.read_text()
    print("\n".join(line for line in text.splitlines() if "data:image/png;base64," not in line))
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


def cmd_serve(args) -> int:
    """Serve a registered model (name@champion, name/3) or a checkpoint folder on its own, outside a pipeline."""
    import datetime as _dt

    from flows.config import ConfigError, load
    from tasks import events, tracking
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
        if not Path(args.ref).is_dir():
            print(f"baton serve: {args.ref}: not a folder (an HF checkpoint is a folder)", file=sys.stderr)
            return 2
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
                       input_format="hf-safetensors", runtimes=cfg.engine_runtimes(),
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


def _config_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What names a run: the config, the stages, overrides and the input (shared by run and config)."""
    p.add_argument("config")
    p.add_argument("--stages", help="comma-separated ordered subset, e.g. data,pretrain,convert")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--from", dest="from_ref",
                   help="input checkpoint folder, registered model name@alias, or hf:ORG/NAME[@REVISION]")
    return p


def cmd_k8s(args) -> int:
    """Kubernetes manifests for the config's training stages (written, not applied)."""
    from flows.config import ConfigError, load
    from flows.k8s import Cluster, write_manifests

    try:
        stages = [s.strip() for s in args.stages.split(",") if s.strip()] if args.stages else None
        cfg = load(args.config, args.set, stages, host=False)  # the cluster's nodes host the ranks, not this machine
        cluster = Cluster(namespace=args.namespace, volume_claim=args.volume_claim, train_image=args.image_train or "",
                          orchestrator_image=args.image_orchestrator or "")
        written = write_manifests(cfg, Path(args.out or Path("infra") / "k8s" / cfg.name), cluster)
    except ConfigError as e:
        print(f"baton k8s: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = _config_args(sub.add_parser("run", help="run a pipeline config"))
    r.add_argument("--no-cache", action="store_true", help="re-run stages even when inputs and config are unchanged")
    r.add_argument("--no-wait", action="store_true",
                   help="fail at once when another live run holds a step's lock (default: wait for it)")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="stream Prefect, library and engine logs to the terminal (default: one line per step; the "
                        "logs go to run.log and each step's step.log)")
    r.add_argument("--no-doctor", action="store_true", help="skip the pre-launch checks of `baton doctor`")
    r.add_argument("--smoke", action="store_true",
                   help="every stage a few steps on its smallest layout, with its gates (require_smoke needs one)")
    r.set_defaults(fn=cmd_run)
    c = _config_args(sub.add_parser("config", help="print the resolved config and the planned steps; launch nothing"))
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
    _add_show_and_lineage(sub)
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
    k = sub.add_parser("k8s", help="write Kubernetes manifests (PyTorchJob, JobSet, RayJob, Prefect work pool)")
    k.add_argument("config")
    k.add_argument("--stages", help="comma-separated ordered subset, e.g. pretrain,finetune")
    k.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    k.add_argument("--out", help="output folder (default: infra/k8s/<config name>)")
    k.add_argument("--namespace", default="default")
    k.add_argument("--volume-claim", default="baton", help="ReadWriteMany PersistentVolumeClaim mounted at /baton")
    k.add_argument("--image-train", help="training image (default: the name infra/docker/train.Dockerfile builds)")
    k.add_argument("--image-orchestrator",
                   help="image of the Prefect work pool's flow runs (default: the training image)")
    k.set_defaults(fn=cmd_k8s)
    from flows import playbook

    playbook.add_plan_parser(sub)
    playbook.add_doctor_parser(sub)
    playbook.add_batch_parser(sub)
    return ap


def _add_show_and_lineage(sub) -> None:
    sh = sub.add_parser("show", help="print one run's summary (summary.md)")
    sh.add_argument("run", help="run id (see `baton runs`)")
    sh.set_defaults(fn=cmd_show)
    li = sub.add_parser("lineage", help="where a checkpoint came from: data digest → every step → serving")
    li.add_argument("ref", help="name@alias, name/version, a run id or a checkpoint folder")
    li.add_argument("--json", action="store_true")
    li.add_argument("--mermaid", action="store_true", help="the chain as a Mermaid flowchart")
    li.set_defaults(fn=cmd_lineage)


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    os.umask(0o077)  # everything baton writes (BATON_HOME, runs, keys, logs) is the user's alone: dirs 0700, files 0600
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
