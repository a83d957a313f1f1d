"""`baton run` and `baton config`: a pipeline config run, or resolved and planned without launching."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from tasks.stage import Status


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

    def exit_for(signum, frame):
        _bound_the_exit(128 + signum)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_for)


EXIT_GRACE_S = 60
EXIT_GRACE_WITHOUT_PREFECT_S = 10  # Prefect's workers would only keep trying a server that is gone


def _bound_the_exit(code: int, grace_s: float | None = None, since: str = "the signal") -> None:
    """The exit hooks (Prefect's log and event workers draining, its temporary server stopping, MLflow) take seconds,
    but once, in five whole suite runs, baton was still exiting a minute after a SIGTERM with the run already recorded
    cancelled. Whoever sent the signal (a stopping container, a scheduler) must not wait on that: after EXIT_GRACE_S the
    stacks of every thread go to the run log (to find the cause), the processes below us are stopped, and we exit.
    After a run whose Prefect server went away, its workers would only retry that server: EXIT_GRACE_WITHOUT_PREFECT_S."""
    import faulthandler
    import threading
    import time

    grace_s = EXIT_GRACE_S if grace_s is None else grace_s

    def watchdog():
        time.sleep(grace_s)
        print(f"baton: exit hooks still running {grace_s:.0f}s after {since}; their stacks:", file=sys.stderr,
              flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _stop_children()
        os._exit(code)

    threading.Thread(target=watchdog, name="baton-exit-watchdog", daemon=True).start()


def _stop_children(grace_s: float = 5.0) -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def cmd_run(args) -> int:
    from flows.config import ConfigError
    from flows.cli.playbook import preflight

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
    from flows import runs
    from flows.cli import view as views
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
    code = _report_run(out, run_dir, error)
    from tasks import orchestration

    if orchestration.lost():  # the run has ended, its records are written: nothing left to wait for
        _bound_the_exit(code, EXIT_GRACE_WITHOUT_PREFECT_S, "the run's end (the Prefect server is gone)")
    return code


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


def _terminal_width(out) -> int | None:
    try:
        return os.get_terminal_size(out.fileno()).columns if out.isatty() else None
    except (OSError, ValueError, AttributeError):
        return None


def _report_run(out, run_dir: Path, error: Exception | None) -> int:
    """The summary table, each failed step's cause and log tail, and the run folder (always the last line)."""
    from flows.cli import view as views

    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"stages": []}
    error = _unless_only_prefect_lost(error, summary)
    lines = views.summary_lines(summary, _terminal_width(out))
    failed = [s for s in summary["stages"] if s.get("status") == Status.FAILED]
    for entry in failed:
        lines += [""] + views.failure_report(entry)
    if error is not None and not failed:
        lines += ["", f"baton: {str(error).splitlines()[0]}"]
    lines += _tracking_missing_lines(summary) + _orchestration_lost_lines(summary)
    out.write("\n".join(lines + [str(run_dir)]) + "\n")
    out.flush()
    return 1 if error is not None else 0


def _unless_only_prefect_lost(error: Exception | None, summary: dict) -> Exception | None:
    """With the Prefect server gone, the pipeline flow run's own end fails after the run has ended: its summary,
    written before, is final and says how it went. None when that is completed."""
    from tasks import orchestration

    if error is None or not orchestration.lost() or not orchestration.is_outage(error):
        return error
    return None if summary.get("status") == Status.COMPLETED else error


def _orchestration_lost_lines(summary: dict) -> list[str]:
    """One line: the Prefect server went away; what it never got is in summary.json."""
    from tasks import orchestration

    lost = [*summary.get(orchestration.ORCHESTRATION_LOST, []),
            *(f"{s['label']}: {m}" for s in summary["stages"] for m in s.get(orchestration.ORCHESTRATION_LOST, []))]
    if not lost:
        return []
    return ["", f"the Prefect server {orchestration.api_url()} went away during the run, which went on without it; "
                f"not recorded there: {'; '.join(lost)} (summary.json has everything)"]


def _tracking_missing_lines(summary: dict) -> list[str]:
    """What the tracking server never got while it was unreachable (summary.json lists the same)."""
    from tasks import tracking

    found = [f"run: {m}" for m in summary.get(tracking.MISSING, [])]
    found += [f"{s['label']}: {m}" for s in summary["stages"] for m in s.get(tracking.MISSING, [])]
    if not found:
        return []
    return ["", f"not recorded in MLflow (the tracking server {tracking.tracking_uri()} was unreachable):",
            *(f"  {line}" for line in found)]


def _planned_input(cfg, from_ref: str | None) -> tuple[str | None, str | None, str]:
    """(format, fingerprint, description) of the first stage's input, without starting anything."""
    from conversions import manifest as mf
    from flows import chain_planner as planning
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

    from flows import chain_planner as planning
    from flows.config import ConfigError, load
    from flows.runs import Index
    from tasks.registry import STAGES

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
        rec = index.get(st.fingerprint)
        last = (index.last(cfg.name, st.label) or {}).get("facts")
        state = (Status.CACHED if (rec or {}).get("status") == Status.COMPLETED and STAGES[st.name].cacheable else
                 "to run: " + "; ".join(r.text() for r in planning.why_run(st, rec, last, use_cache=True)))
        formats = f"{st.consumes or '-'} -> {st.produces or '-'}"
        print(f"#   {st.label:<28} {formats:<38} {st.fingerprint[:12]}  {state}")
    return 0


def _config_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What names a run: the config, the stages, overrides and the input (shared by run and config)."""
    p.add_argument("config")
    p.add_argument("--stages", help="comma-separated ordered subset, e.g. data,pretrain,convert")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--from", dest="from_ref",
                   help="input checkpoint folder, registered model name@alias, or hf:ORG/NAME[@REVISION]")
    return p


def add_parsers(sub) -> None:
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
