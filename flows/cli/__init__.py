"""`baton`: run pipelines, verify and describe checkpoints, list runs.

Config errors are reported before Prefect, MLflow or any engine is imported, so they come back in about a second.
"""
from __future__ import annotations

import argparse
import os
import sys

from conversions.home import ENV as HOME_ENV, home_path
from conversions.refusal import Refused


# Offline, no telemetry, and time enough for Prefect's ephemeral server to migrate its database on 2 cores.
QUIET_ENV = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _env_defaults() -> None:
    from tasks import orchestration

    for k, v in QUIET_ENV.items():
        os.environ.setdefault(k, v)
    orchestration.set_client_defaults()
    home = home_path().resolve()
    os.environ[HOME_ENV] = str(home)
    stack = home / "stack.env"  # written by `make up`: use the running Prefect and MLflow servers
    if os.path.lexists(stack):
        from tasks import stack_env

        try:
            settings = stack_env.read(stack)
        except stack_env.StackEnvError as e:
            raise SystemExit(f"baton: {e}") from None
        for k, v in settings.items():
            os.environ.setdefault(k, v)


def build_parser() -> argparse.ArgumentParser:
    """One subcommand group per module of flows/cli; each adds its own subcommands."""
    from flows.cli import checkpoint, export, history, imports, k8s, playbook, run, serve

    ap = argparse.ArgumentParser(prog="baton", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for group in (run, checkpoint, export, imports, history, serve, k8s, playbook):
        group.add_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    _env_defaults()
    os.umask(0o077)  # everything baton writes (BATON_HOME, runs, keys, logs) is the user's alone: dirs 0700, files 0600
    try:
        args = build_parser().parse_args(argv)  # (the parser's modules load the stages, plug-ins included)
        return args.fn(args)
    except Refused as e:  # an expected failure no command caught: its one line, not a traceback of baton's frames
        print(f"baton: {e}", file=sys.stderr)
        return 2
