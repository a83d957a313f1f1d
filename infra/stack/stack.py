#!/usr/bin/env python3
"""The local operations stack on loopback: a Prefect server, a process work pool with a worker, an MLflow server.

    stack.py up [--db sqlite|postgres] [--no-worker] [--no-deploy]     (make up [DB=postgres])
    stack.py down [--purge]                                              (make down)
    stack.py status

Everything lives under $BATON_HOME/stack: databases, artifacts, logs, pid files, and secrets.env: the credentials
both servers ask for (Prefect's API auth string, MLflow's basic-auth admin), generated on the first `up` in this
BATON_HOME, 0600, handed to the servers, the worker and clients through their environment only (never a command line).
`up` writes $BATON_HOME/stack.env (the client settings `baton` reads, credentials included, 0600), `down` stops every
process group it started and removes stack.env; `down --purge` deletes secrets.env with the databases.
Ports: BATON_PREFECT_PORT (4211), BATON_MLFLOW_PORT (5011), BATON_PG_PORT (5433). Standard library only; run it
with the venv's python (prefect and mlflow are taken from beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import postgres  # noqa: E402  (beside this file)
from tasks.health import Unhealthy, wait_http_ok  # noqa: E402  (the checkout is on .venv's path)
from tasks import orchestration, stack_env  # noqa: E402
from conversions.home import home_path  # noqa: E402
from tasks.launch import kill_group  # noqa: E402

POOL = os.environ.get("BATON_WORK_POOL", "baton-local")
HOST = "127.0.0.1"
MLFLOW_ADMIN = "baton"  # the MLflow basic-auth admin user clients log in as


def home() -> Path:
    return home_path(REPO).resolve()


def state_dir() -> Path:
    return home() / "stack"


def ports() -> dict[str, int]:
    return {"prefect": int(os.environ.get("BATON_PREFECT_PORT", 4211)),
            "mlflow": int(os.environ.get("BATON_MLFLOW_PORT", 5011)),
            "postgres": int(os.environ.get("BATON_PG_PORT", 5433))}


def bin_dir() -> Path:
    """The venv whose python runs this script (make passes .venv/bin/python): prefect and mlflow live beside it."""
    return Path(sys.executable).parent


def log(msg: str) -> None:
    print(f"[stack] {msg}", flush=True)


# ---- settings ------------------------------------------------------------------------------------------------------
def client_env() -> dict[str, str]:
    """What a client needs to use the stack: written to stack.env, given to the worker and to `prefect deploy`."""
    p = ports()
    api = f"http://{HOST}:{p['prefect']}/api"
    return {"PREFECT_API_URL": api, "PREFECT_UI_URL": f"http://{HOST}:{p['prefect']}",
            "MLFLOW_TRACKING_URI": f"http://{HOST}:{p['mlflow']}", "BATON_WORK_POOL": POOL}


def secrets_file() -> Path:
    return state_dir() / "secrets.env"


SECRETS_HEADER = "# the stack's credentials, generated once by `make up`; `stack.py down --purge` deletes them\n"


def credentials() -> dict[str, str]:
    """The stack's credentials (stack_env.CREDENTIAL_KEYS): generated on the first `up` in this BATON_HOME, then read
    back, since MLflow creates its admin user once, with the password it is first given."""
    f = secrets_file()
    if os.path.lexists(f):
        creds = stack_env.read(f)  # the user's own 0600 file, or refused naming it
        if set(creds) != set(stack_env.CREDENTIAL_KEYS):
            raise stack_env.StackEnvError(f"{f}: holds {', '.join(sorted(creds)) or 'nothing'}, not the stack's "
                                          f"credentials ({', '.join(stack_env.CREDENTIAL_KEYS)}); "
                                          "`stack.py down --purge` starts afresh")
        return creds
    creds = {"PREFECT_API_AUTH_STRING": f"baton:{secrets.token_urlsafe(32)}",
             "MLFLOW_TRACKING_USERNAME": MLFLOW_ADMIN, "MLFLOW_TRACKING_PASSWORD": secrets.token_urlsafe(32)}
    f.parent.mkdir(parents=True, exist_ok=True)
    stack_env.write(f, creds, header=SECRETS_HEADER)
    return creds


def quiet_env() -> dict[str, str]:
    return {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def prefect_server_env(db_url: str | None, auth_string: str) -> dict[str, str]:
    s, p = state_dir() / "prefect", ports()
    env = {"PREFECT_HOME": str(s), "PREFECT_LOCAL_STORAGE_PATH": str(s / "storage"),
           "PREFECT_SERVER_API_HOST": HOST, "PREFECT_SERVER_API_PORT": str(p["prefect"]),
           # the UI is a static app that calls this URL from the browser: without it, it calls port 4200
           "PREFECT_UI_API_URL": f"http://{HOST}:{p['prefect']}/api",
           "PREFECT_API_DATABASE_CONNECTION_URL": db_url or f"sqlite+aiosqlite:///{s / 'prefect.db'}",
           # a web page the user visits must not drive the API: CSRF tokens on every write (Prefect's clients and UI
           # fetch them), and cross-origin reads only for the UI's own origin (Prefect's default is `*`)
           "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
           "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{p['prefect']}",
           # every API call but the health probe needs it (HTTP basic auth); the UI asks for it on its login page
           "PREFECT_SERVER_API_AUTH_STRING": auth_string}
    return env


def mlflow_server_env(db_url: str | None, creds: dict[str, str]) -> dict[str, str]:
    """MLflow's basic-auth app: its users in an SQLite database beside the tracking store, the admin user created on
    the first start with the stack's credentials; everything but /health asks for them."""
    s = state_dir() / "mlflow"
    ini = s / "basic_auth.ini"
    ini.write_text(f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{s / 'auth.db'}\n"
                   f"admin_username = {creds['MLFLOW_TRACKING_USERNAME']}\n")
    # GenAI job execution off: otherwise MLflow spawns ~7 huey consumers (~2 GB) that tracking does not need.
    # The store URI (with the database password) and the admin password through the environment: never on a command
    # line (`ps`). The Flask key signs the sign-up form's CSRF token only: a fresh one per start does.
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_BACKEND_STORE_URI": db_url or f"sqlite:///{s / 'mlflow.db'}",
            "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": creds["MLFLOW_TRACKING_PASSWORD"],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_urlsafe(32)}


def fast_admin_check(creds: dict[str, str]) -> None:
    """MLflow checks the password of every request against the stored hash, which it makes with werkzeug's default
    scrypt: 0.15 s of CPU per request on this 2-core machine, on every metric a run logs. The admin's password is 256
    random bits, not a word a person chose, so a slow hash buys nothing: its hash becomes one round of PBKDF2-SHA256
    in werkzeug's own format (MLflow reads the method from the hash at each check)."""
    import hashlib
    import sqlite3

    password = creds["MLFLOW_TRACKING_PASSWORD"]
    salt = secrets.token_hex(8)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), 1).hex()
    with sqlite3.connect(state_dir() / "mlflow" / "auth.db", timeout=30) as db:
        db.execute("UPDATE users SET password_hash = ? WHERE username = ?",
                   (f"pbkdf2:sha256:1${salt}${digest}", creds["MLFLOW_TRACKING_USERNAME"]))


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(quiet_env())
    env["BATON_HOME"] = str(home())
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env


# ---- processes -----------------------------------------------------------------------------------------------------
def pid_file(name: str) -> Path:
    return state_dir() / "pids" / f"{name}.pid"


def start(name: str, cmd: list[str], env: dict) -> int:
    """Start a long-running process in its own session (so `down` can stop its whole tree) with its log file."""
    (state_dir() / "logs").mkdir(parents=True, exist_ok=True)
    pid_file(name).parent.mkdir(parents=True, exist_ok=True)
    logf = open(state_dir() / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    logf.close()
    pid_file(name).write_text(str(proc.pid))
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of a caller that never waited counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def stop(name: str, grace: float = 15.0) -> None:
    """SIGTERM the process group, wait, then SIGKILL (a Prefect worker ignores SIGTERM for a while)."""
    f = pid_file(name)
    if not f.exists():
        return
    pid = int(f.read_text().strip())
    kill_group(pid, grace)
    f.unlink(missing_ok=True)
    log(f"stopped {name} (pid {pid})")


def wait_http(url: str, name: str, pid_name: str, timeout: float = 240.0) -> float:
    pid = int(pid_file(pid_name).read_text())
    try:
        return wait_http_ok(url, timeout, alive=lambda: alive(pid), interval=0.5)
    except Unhealthy as e:
        if e.exited:
            tail = (state_dir() / "logs" / f"{pid_name}.log").read_text(errors="replace").splitlines()[-25:]
            raise SystemExit(f"[stack] {name} exited before it answered {url}:\n" + "\n".join(tail)) from None
        raise SystemExit(f"[stack] {name} did not answer {url} within {timeout:.0f}s "
                         f"(log: {state_dir() / 'logs' / (pid_name + '.log')})") from None


def run_cli(cmd: list[str], env: dict, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"[stack] {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc.stdout


# ---- one stack per port: a second BATON_HOME's `make up` would answer the first one's clients (with 401s) ----------
def owners_dir() -> Path:
    """User-wide (not per BATON_HOME): who started the stack listening on each port."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "baton" / "stack-ports"


def listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def refuse_taken_ports() -> None:
    for name, port in ports().items():
        if name == "postgres" or not listening(port):
            continue
        f = owners_dir() / f"{port}.json"
        owner = json.loads(f.read_text()).get("home") if f.exists() else None
        raise SystemExit(f"[stack] port {port} ({name}) is already in use by "
                         f"{'the stack of BATON_HOME=' + owner if owner else 'another process'}; run `make down` "
                         f"there, or give this stack its own ports (BATON_PREFECT_PORT, BATON_MLFLOW_PORT, "
                         f"BATON_PG_PORT)")


def claim_ports() -> None:
    owners_dir().mkdir(parents=True, exist_ok=True)
    for name, port in ports().items():
        (owners_dir() / f"{port}.json").write_text(json.dumps({"home": str(home()), "server": name}) + "\n")


def release_ports() -> None:
    for port in ports().values():
        f = owners_dir() / f"{port}.json"
        if f.exists() and json.loads(f.read_text()).get("home") == str(home()):
            f.unlink()


# ---- up / down -----------------------------------------------------------------------------------------------------
def up(db: str, worker: bool, deploy: bool) -> None:
    if (home() / "stack.env").exists() and any(alive(int(f.read_text())) for f in (state_dir() / "pids").glob("*.pid")):
        log(f"already up ({home() / 'stack.env'}); `make down` first to restart it")
        print_addresses()
        return
    refuse_taken_ports()
    t0 = time.time()
    state_dir().mkdir(parents=True, exist_ok=True)
    try:
        creds = credentials()
    except stack_env.StackEnvError as e:
        raise SystemExit(f"[stack] {e}") from None
    env = base_env()
    p = ports()
    prefect_db = mlflow_db = None
    if db == "postgres":
        pg = postgres.Cluster(state_dir(), home(), p["postgres"])
        pg.start()
        prefect_db, mlflow_db = pg.url("prefect", "postgresql+asyncpg"), pg.url("mlflow", "postgresql+psycopg2")
    (state_dir() / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
    start("prefect-server", [str(bin_dir() / "prefect"), "server", "start", "--analytics-off"],
          {**env, **prefect_server_env(prefect_db, creds["PREFECT_API_AUTH_STRING"])})
    start("mlflow-server", [str(bin_dir() / "mlflow"), "server", "--app-name", "basic-auth", "--host", HOST,
                            "--port", str(p["mlflow"]), "--artifacts-destination",
                            str(state_dir() / "mlflow" / "artifacts"), "--workers", "1"],
          {**env, **mlflow_server_env(mlflow_db, creds)})
    cenv = {**env, **client_env(), **creds}
    s1 = wait_http(f"http://{HOST}:{p['prefect']}/api/health", "Prefect server", "prefect-server")
    s2 = wait_http(f"http://{HOST}:{p['mlflow']}/health", "MLflow server", "mlflow-server")
    fast_admin_check(creds)
    log(f"Prefect API up after {s1:.0f}s, MLflow after {s2:.0f}s")
    stack_env.write(home() / "stack.env", {**client_env(), **creds})  # 0600: baton refuses it otherwise
    claim_ports()
    (state_dir() / "stack.json").write_text(json.dumps({"db": db, "ports": p, "pool": POOL}, indent=2) + "\n")
    boot = [str(bin_dir() / "python"), str(Path(__file__).resolve().parent / "bootstrap.py")]
    if worker:
        print(run_cli(boot + ["--pool", POOL], cenv), end="", flush=True)
        # heartbeats let the "crash zombie flows" automation mark runs whose process died as Crashed
        # the flow runs it starts inherit its environment: their Prefect client retries bounded as `baton`'s are, so
        # a deployment run that loses the server goes on without it as quickly (a value in the environment wins)
        start("prefect-worker", [str(bin_dir() / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"],
              {**orchestration.CLIENT_DEFAULTS, **cenv,
               "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")})
    else:
        print(run_cli(boot, cenv), end="", flush=True)
    if deploy:
        deploy_all(cenv)
    previous = activate_profile(creds["PREFECT_API_AUTH_STRING"])
    log(f"Prefect profile '{PROFILE}' active (the `prefect` CLI now talks to this stack; `make down` makes "
        f"'{previous or 'ephemeral'}' active again)")
    log(f"up in {time.time() - t0:.0f}s (db: {db}); client settings in {home() / 'stack.env'}")
    print_addresses()


PROFILE = "baton"


def activate_profile(auth_string: str | None = None) -> str:
    """A `baton` Prefect profile pointing at the stack (with its auth string), made active, so `prefect ...` in any
    fresh shell talks to it (instead of starting its own temporary server). The profile it replaces is remembered for
    `down`. The profiles file then holds a secret: it is made 0600, as Prefect creates it."""
    from prefect.settings import get_current_settings, load_profiles, save_profiles

    profiles = load_profiles()
    previous = profiles.active_name if profiles.active_name != PROFILE else _previous_profile()
    env = client_env()
    settings = {"PREFECT_API_URL": env["PREFECT_API_URL"], "PREFECT_UI_URL": env["PREFECT_UI_URL"]}
    if auth_string:
        settings["PREFECT_API_AUTH_STRING"] = auth_string
    profiles.update_profile(PROFILE, settings=settings)
    profiles.set_active(PROFILE)
    path = get_current_settings().profiles_path
    if path.exists():
        path.chmod(0o600)  # before the secret is written into it
    save_profiles(profiles)
    state_dir().mkdir(parents=True, exist_ok=True)
    (state_dir() / "previous_prefect_profile").write_text(previous or "")
    return previous or ""


def _previous_profile() -> str:
    f = state_dir() / "previous_prefect_profile"
    return f.read_text().strip() if f.exists() else ""


def restore_profile() -> str | None:
    """Make the profile that was active before `up` active again; the `baton` profile goes away."""
    from prefect.settings import load_profiles, save_profiles

    profiles = load_profiles()
    if PROFILE not in profiles.names:
        return None
    previous = _previous_profile() or "ephemeral"
    if profiles.active_name == PROFILE:
        profiles.set_active(previous if previous in profiles.names else "ephemeral", check=False)
    profiles.remove_profile(PROFILE)
    save_profiles(profiles)
    (state_dir() / "previous_prefect_profile").unlink(missing_ok=True)
    return profiles.active_name


def deploy_all(cenv: dict) -> None:
    t0 = time.time()
    run_cli([str(bin_dir() / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(REPO / "prefect.yaml")],
            {**cenv, "BATON_REPO": str(REPO)})
    log(f"deployed every deployment in prefect.yaml in {time.time() - t0:.0f}s")


def print_addresses() -> None:
    env = client_env()
    print(f"Prefect UI: {env['PREFECT_UI_URL']}  (login: the value of PREFECT_API_AUTH_STRING in "
          f"{home() / 'stack.env'})\nMLflow UI:  {env['MLFLOW_TRACKING_URI']}  (user and password: "
          "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD there)", flush=True)


def stop_serving() -> None:
    """The model server retraining keeps up (detached, recorded in $BATON_HOME/serving.json: its supervisor, engine and
    any side-port candidate) goes down with the stack; each pid only while its start time still matches."""
    from tasks.serve.supervisor import read_json, stop_recorded

    f = home() / "serving.json"
    current = read_json(f) or {}
    for server in ((current.get("candidate") or {}).get("server"), current.get("server")):
        if server:
            stop_recorded(server)
            log(f"stopped the model server (supervisor pid {server.get('pid')})")
    f.unlink(missing_ok=True)


def down(purge: bool) -> None:
    for name in ("prefect-worker", "prefect-server", "mlflow-server"):
        stop(name)
    stop_serving()
    if postgres.Cluster.exists(state_dir(), home()):
        postgres.Cluster(state_dir(), home(), ports()["postgres"]).stop(purge=purge)
    (home() / "stack.env").unlink(missing_ok=True)
    release_ports()
    restored = restore_profile()
    if restored:
        log(f"Prefect profile '{restored}' active again")
    if purge:
        import shutil

        shutil.rmtree(state_dir(), ignore_errors=True)
    log("down")


def status() -> int:
    up_ = 0
    for f in sorted((state_dir() / "pids").glob("*.pid")):
        pid = int(f.read_text())
        ok = alive(pid)
        up_ += ok
        print(f"{f.stem:<16} pid {pid:<8} {'running' if ok else 'gone'}")
    if (home() / "stack.env").exists():
        print_addresses()
    return 0 if up_ else 1


def main() -> int:
    os.umask(0o077)  # BATON_HOME, stack.env, the servers' databases and logs: the user's alone
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("--db", choices=["sqlite", "postgres"], default=os.environ.get("DB") or "sqlite")
    u.add_argument("--no-worker", action="store_true", default=os.environ.get("WORKER") == "0",
                   help="no work pool, worker or automation (make up WORKER=0)")
    u.add_argument("--no-deploy", action="store_true", default=os.environ.get("DEPLOY") == "0",
                   help="skip `prefect deploy --all` (make up DEPLOY=0)")
    d = sub.add_parser("down")
    d.add_argument("--purge", action="store_true", help="also delete the databases, artifacts, logs and credentials")
    sub.add_parser("status")
    a = ap.parse_args()
    if a.cmd == "up":
        try:
            up(a.db, worker=not a.no_worker, deploy=not (a.no_deploy or a.no_worker))
        except BaseException:
            log("start-up failed: stopping what was started")
            down(purge=False)
            raise
        return 0
    if a.cmd == "down":
        down(a.purge)
        return 0
    return status()


if __name__ == "__main__":
    sys.exit(main())
