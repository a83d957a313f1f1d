"""A PostgreSQL cluster for the stack (`make up DB=postgres`), from Debian's `postgresql` package.

One cluster per BATON_HOME, listening on 127.0.0.1 only, with a `baton` role (random password, kept 0600 in
$BATON_HOME/stack/postgres.json) owning two databases: `prefect` and `mlflow`. PostgreSQL refuses to run as root, so
as root the cluster runs as the `postgres` user in a folder that user owns (/var/tmp/baton-postgres-<id>).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

ROLE = "baton"
DATABASES = ("prefect", "mlflow")


def pg_bin(tool: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"), key=lambda p: int(p.split("/")[4]))
    if found:
        return found[-1]
    if shutil.which(tool):
        return shutil.which(tool)
    raise SystemExit(f"[stack] PostgreSQL's {tool} not found: install Debian's package "
                     "(apt-get install -y postgresql) or use the default DB=sqlite")


class Cluster:
    def __init__(self, state_dir: Path, home: Path, port: int):
        self.info_path = state_dir / "postgres.json"
        info = json.loads(self.info_path.read_text()) if self.info_path.exists() else {}
        if os.geteuid() == 0:
            root = Path(f"/var/tmp/baton-postgres-{hashlib.sha256(str(home).encode()).hexdigest()[:12]}")
        else:
            root = state_dir / "postgres"
        self.root = Path(info.get("root", root))
        self.port = int(info.get("port", port))
        self.password = os.environ.get("BATON_PG_PASSWORD") or info.get("password") or secrets.token_hex(16)
        self.admin_password = info.get("admin_password") or secrets.token_hex(16)
        self.data = self.root / "data"

    @staticmethod
    def exists(state_dir: Path, home: Path) -> bool:
        return (state_dir / "postgres.json").exists()

    def _as_owner(self, cmd: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd

    def _run(self, cmd: list[str], check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
        # the superuser's password through the environment (never a command line); runuser keeps PGPASSWORD
        env = dict(os.environ, PGPASSWORD=self.admin_password)
        proc = subprocess.run(self._as_owner(cmd), capture_output=True, text=True, cwd="/", env=env, input=stdin)
        if check and proc.returncode != 0:
            raise SystemExit(f"[stack] {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return proc

    def _psql(self, sql: str, db: str = "postgres") -> str:
        """SQL on stdin: a statement carrying a password never shows on a command line."""
        return self._run([pg_bin("psql"), "-h", str(self.root), "-p", str(self.port), "-U", "postgres", "-d", db,
                          "-v", "ON_ERROR_STOP=1", "-tA"], stdin=sql).stdout.strip()

    def _save(self) -> None:
        self.info_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.info_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"root": str(self.root), "port": self.port, "password": self.password,
                       "admin_password": self.admin_password}, f)

    def start(self) -> None:
        self._save()
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
            os.chmod(self.root, 0o700)
        if not (self.data / "PG_VERSION").exists():
            print(f"[stack] initialising PostgreSQL in {self.data}", flush=True)
            self._initdb()
        self._require_passwords()
        if self._run([pg_bin("pg_ctl"), "-D", str(self.data), "status"], check=False).returncode != 0:
            self._run([pg_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"), "-w", "-t", "60",
                       "-o", f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}", "start"])
        if self._psql(f"SELECT 1 FROM pg_roles WHERE rolname = '{ROLE}'") != "1":
            self._psql(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{self.password}'")
        else:
            self._psql(f"ALTER ROLE {ROLE} PASSWORD '{self.password}'")
        for db in DATABASES:
            if self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'") != "1":
                self._psql(f"CREATE DATABASE {db} OWNER {ROLE}")
        print(f"[stack] PostgreSQL on 127.0.0.1:{self.port} (databases: {', '.join(DATABASES)})", flush=True)

    def _initdb(self) -> None:
        """Password authentication everywhere (the socket too): the superuser's password from a 0600 file that only
        initdb reads, then removed."""
        pwfile = self.root / ".pwfile"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.admin_password + "\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, "postgres", "postgres")
        try:
            self._run([pg_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-E", "UTF8",
                       "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
                       "--no-instructions"])
        finally:
            pwfile.unlink(missing_ok=True)

    def _require_passwords(self) -> None:
        """A cluster initialised by an older baton trusted local connections: refuse to start it that way."""
        hba = self.data / "pg_hba.conf"
        try:
            text = hba.read_text()
        except PermissionError:
            text = self._run(["cat", str(hba)]).stdout
        if any(line.split()[-1:] == ["trust"] for line in text.splitlines() if line.strip() and line[0] != "#"):
            raise SystemExit(f"[stack] {hba} trusts connections without a password (made by an older baton): "
                             "`make down PURGE=1` (or remove the cluster) and `make up DB=postgres` again")

    def url(self, db: str, driver: str) -> str:
        return f"{driver}://{ROLE}:{self.password}@127.0.0.1:{self.port}/{db}"

    def stop(self, purge: bool = False) -> None:
        if (self.data / "PG_VERSION").exists() or (os.geteuid() == 0 and self.root.exists()):
            self._run([pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"], check=False)
            print(f"[stack] stopped PostgreSQL ({self.data})", flush=True)
        if purge:
            shutil.rmtree(self.root, ignore_errors=True)
            self.info_path.unlink(missing_ok=True)
