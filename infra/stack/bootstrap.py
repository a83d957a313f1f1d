"""The stack's server-side set-up in one process (each `prefect` CLI call costs seconds of imports):
the MLflow experiment (created through the server, so artifacts go to the server's artifact root), the process work
pool, and the automations in infra/prefect/automations.py. Idempotent; run by `stack.py up`."""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ensure_experiment(name: str) -> str:
    from tasks import tracking

    c = tracking.client()
    exp = tracking.experiment_id(c, name)
    c.set_experiment_tag(exp, "mlflow.experimentKind", "custom_model_development")  # the UI opens on training runs
    return f"experiment {name}: {c.get_experiment(exp).artifact_location}"


def ensure_pool(name: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return f"work pool {name}: exists"
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
            return f"work pool {name}: created (process)"


def main() -> None:
    print(f"[stack] {ensure_experiment(os.environ.get('BATON_EXPERIMENT', 'baton'))}", flush=True)
    if "--pool" in sys.argv:
        print(f"[stack] {ensure_pool(sys.argv[sys.argv.index('--pool') + 1])}", flush=True)
        sys.path.insert(0, str(REPO / "infra" / "prefect"))
        import automations

        print(f"[stack] automation {automations.ensure(automations.crash_zombie_flows())}", flush=True)


if __name__ == "__main__":
    main()
