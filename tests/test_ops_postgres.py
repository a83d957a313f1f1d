"""`make up DB=postgres`: both servers on a real PostgreSQL (Debian's package, initialised and started by the stack
script), used by `baton run` through stack.env; `make down` stops PostgreSQL too."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from ops_stack import REPO, Stack, stack_home, runs_tagged


def _pg_rows(stack: Stack, db: str, sql: str) -> list[tuple]:
    import psycopg2

    info = json.loads((stack.home / "stack" / "postgres.json").read_text())
    with psycopg2.connect(host="127.0.0.1", port=info["port"], dbname=db, user="baton",
                          password=info["password"]) as conn, conn.cursor() as cur:
        cur.execute(sql)
        return cur.fetchall()


@pytest.mark.long  # its own stack on PostgreSQL, ~75 s; `make test`'s stack runs on SQLite
def test_stack_on_postgres(tmp_path):
    subprocess.run(["bash", str(REPO / "infra" / "stack" / "system-deps.sh"), "postgresql"], check=True, timeout=900)
    stack = Stack(stack_home("baton-pg-"), db="postgres")
    try:
        stack.up(DEPLOY="0")
        print(f"make up DB=postgres: {stack.up_seconds:.1f}s")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "run", "configs/tiny.yaml", "--stages", "data"],
                              cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        print(f"baton run --stages data on the postgres stack: {time.time() - t0:.1f}s")
        summary = json.loads((stack.home / "runs" / proc.stdout.strip().splitlines()[-1].split("/")[-1]
                              / "summary.json").read_text())
        fr_id = summary["prefect_flow_run_id"]
        # the flow run and its stage subflow are rows in Prefect's PostgreSQL database...
        rows = _pg_rows(stack, "prefect", f"SELECT name, state_type FROM flow_run WHERE id = '{fr_id}' "
                                          f"OR parent_task_run_id IS NOT NULL")
        assert ("data", "COMPLETED") in rows and any(state == "COMPLETED" for _, state in rows)
        # ...the MLflow parent run and its stage run are rows in MLflow's
        (parent,) = runs_tagged(stack.mlflow(), "prefect.flow_run_id", fr_id)
        names = {n for (n,) in _pg_rows(stack, "mlflow", "SELECT name FROM runs")}
        assert {"data", parent.info.run_name} <= names
        pg = json.loads((stack.home / "stack" / "postgres.json").read_text())
        stack.down(purge=False)
        # make down stopped PostgreSQL with the servers
        probe = subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", str(pg["port"])], capture_output=True)
        assert probe.returncode != 0
        assert not (stack.home / "stack.env").exists()
    finally:
        stack.down(purge=True)
        shutil.rmtree(stack.home, ignore_errors=True)
