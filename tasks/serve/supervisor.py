"""The supervisor of every server baton leaves running on its own (`serve.keep_alive`, retrain's promoted server), so
they are watched the way `baton serve` watches its own: one code path (`hold`) for all of them.

    python supervisor.py --spec SPEC.json        (an events.SupervisorSpec, written by Server.start)

The engine runs in its own process group, killed when the supervisor dies (PR_SET_PDEATHSIG). Its output goes into
LOG (0600) with the secrets from BATON_REDACT (newline-separated, never on a command line, removed from the engine's
environment) replaced by ***. An engine that dies after it was healthy is restarted (same command, port and key) up to
N times; then the supervisor gives up and exits 3: STATE and serving.json (when it names this supervisor) say "down",
and the champion recorded in `promoted.json` beside STATE (written by whoever promoted the served version) is rolled
back by compare-and-set, as `baton serve` does. SIGTERM stops the engine (its /dev/shm leftovers removed) and exits 0.
"""
from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import sys
import time
from pathlib import Path

if not __package__:  # run as a script by Server.start: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conversions import durable  # noqa: E402
from tasks import events  # noqa: E402
from tasks.launch import kill_group  # noqa: E402
from tasks.serve.records import read_json, running, same_process, started_at  # noqa: E402,F401
from tasks.serve.server import Server, ServerFailed, redactor  # noqa: E402

log = logging.getLogger("baton.serve")
GAVE_UP = 3
PROMOTED = "promoted.json"


def hold(server: Server, restarts: int, health_timeout: float, on_state=None, wanted=None) -> int | None:
    """Watch a healthy server until KeyboardInterrupt or until wanted() turns false (None). An engine that dies is
    restarted up to `restarts` times (on_state("restarting", n) once the n-th restart started, on_state("serving", n)
    once it is healthy); then its exit code is returned (never 0: a server that ends is a failure)."""
    on_state = on_state or (lambda status, used: None)
    wanted = wanted or (lambda: True)
    deaths = 0
    try:
        while True:
            while server.proc.poll() is None:
                if not wanted():
                    return None
                time.sleep(1.0)
            code = server.proc.returncode or 1
            if deaths >= restarts:
                log.error("%s server exited with code %s while serving; %d restarts used", server.name, code, restarts)
                return code
            deaths += 1
            log.warning("%s server died (exit %s); restart %d of %d", server.name, code, deaths, restarts)
            server.stop()
            server.start()
            on_state("restarting", deaths)
            try:
                server.wait_healthy(health_timeout)
                on_state("serving", deaths)
            except ServerFailed as e:
                log.warning("%s restart failed: %s", server.name, str(e).splitlines()[0])
    except KeyboardInterrupt:
        return None
    finally:
        server.stop()


# ---- records of a detached server (read by whoever stops or reconciles it) -----------------------------------------
def alive(server: dict | None) -> bool:
    """The recorded supervisor still runs (and has not given up)."""
    server = server or {}
    state = read_json(server.get("state")) or {}
    return same_process(server.get("pid"), server.get("started_at")) and state.get("status") != "down"


def stop_recorded(server: dict | None, grace: float = 30.0) -> None:
    """Stop a recorded server: its supervisor (which stops its engine), then the engine should it be left; each pid
    only while it still is the recorded process."""
    server = server or {}
    state = read_json(server.get("state")) or {}
    for (pid, started), wait in (((server.get("pid"), server.get("started_at")), grace),
                                 ((server.get("engine_pid"), server.get("engine_started_at")), 15.0),
                                 ((state.get("engine_pid"), state.get("engine_started_at")), 15.0)):
        if pid and same_process(pid, started):
            kill_group(int(pid), wait, alive=lambda _g, pid=pid, started=started: running(pid, started))


def serving_file() -> Path:
    from tasks.tracking import baton_home

    return baton_home() / "serving.json"


def update_serving(change) -> dict | None:
    """Read-modify-write serving.json under its lock; change(current or None) returns the new content (None: remove)."""
    import filelock

    path = serving_file()
    with filelock.FileLock(str(path) + ".lock", timeout=120):
        new = change(read_json(path))
        if new is None:
            path.unlink(missing_ok=True)
        else:
            durable.write_json(path, new)
        return new


def _names_me(server: dict | None) -> bool:
    server = server or {}
    return server.get("pid") == os.getpid() and same_process(os.getpid(), server.get("started_at"))


# ---- the supervisor process ----------------------------------------------------------------------------------------
class Supervision:
    def __init__(self, server: Server, state: Path, restarts: int):
        self.server, self.state, self.restarts = server, state, restarts
        self.me = {"pid": os.getpid(), "started_at": started_at(os.getpid())}
        self.engine: tuple[int | None, float | None] = (None, None)

    def record(self, status: str, used: int = 0, exit_code: int | None = None) -> None:
        engine = self.server.proc.pid if self.server.proc else None
        if engine != self.engine[0]:  # the start time of this engine, read while it runs
            self.engine = (engine, started_at(engine))
        fields = {"engine_pid": engine, "engine_started_at": self.engine[1]}
        durable.write_json(self.state, {**self.me, **fields, "status": status, "restarts_used": used,
                                        "restarts": self.restarts, "exit_code": exit_code,
                                        "base_url": self.server.base_url,
                                        "updated": dt.datetime.now().isoformat(timespec="seconds")})

        def mine(current):
            if current and _names_me(current.get("server")):
                current = {**current, "server": {**current["server"], **fields}, "status": status}
            return current

        if serving_file().exists():
            update_serving(mine)

    def give_up(self, code: int) -> None:
        self.record("down", self.restarts, code)
        promoted = read_json(self.state.with_name(PROMOTED))
        if not promoted:
            return
        from tasks import tracking

        try:
            back = tracking.rollback_champion(tracking.client(), promoted["name"], expected=str(promoted["version"]))
            log.error("champion rolled back from version %s to %s: its server kept dying", back["from"], back["to"])
        except (tracking.AliasMoved, ValueError) as e:
            log.error("champion not rolled back: %s", e)


def records_kept(state: Path):
    """A detached server whose run folder was deleted (BATON_HOME removed) can no longer be found, stopped or
    reconciled by anyone: its supervisor takes it down rather than leave an engine holding the port and the memory."""
    def kept() -> bool:
        if state.parent.is_dir():
            return True
        log.warning("the run folder %s is gone: stopping the server nobody can reach any more", state.parent)
        return False
    return kept


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    spec = events.read_typed_spec(events.SupervisorSpec, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s supervisor %(levelname)s %(message)s")
    secrets = [s for s in os.environ.pop("BATON_REDACT", "").split("\n") if s]
    os.close(os.open(spec.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupt)
    server = Server(spec.name, spec.cmd, {}, spec.url, spec.log, redactor(*secrets), managed=True)
    sup = Supervision(server, spec.state, spec.restarts)
    try:
        server.start()
        sup.record("starting")
        server.wait_healthy(spec.health_timeout_s)
    except ServerFailed as e:
        log.error("%s", str(e).splitlines()[0])
        server.stop()
        sup.record("failed", exit_code=server.proc.returncode)
        return 1
    except KeyboardInterrupt:
        server.stop()
        sup.record("stopped")
        return 0
    sup.record("serving")
    code = hold(server, spec.restarts, spec.health_timeout_s, on_state=sup.record, wanted=records_kept(spec.state))
    if code is None:
        if spec.state.parent.is_dir():
            sup.record("stopped")
        return 0
    sup.give_up(code)
    return GAVE_UP


if __name__ == "__main__":
    sys.exit(main())
