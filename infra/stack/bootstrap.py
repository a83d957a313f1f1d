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


# The process template's variables that choose what the worker runs: the command, its environment (a PYTHONPATH makes
# every engine import the caller's code) and its folder.
LAUNCH_VARIABLES = ("command", "env", "working_dir")


def job_template(allow_launch_variables: bool) -> dict:
    """Prefect's process template; unless the worker's owner allows launch parameters, without LAUNCH_VARIABLES: the
    server then refuses them (422) in any deployment's or flow run's job variables, since its variables schema admits
    no other key, and the worker renders every job from the template's fixed values."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    if allow_launch_variables:
        return template
    variables = template["variables"]
    for key in LAUNCH_VARIABLES:
        variables["properties"].pop(key)
        template["job_configuration"][key] = {} if key == "env" else None
    variables["required"] = [k for k in variables.get("required", []) if k not in LAUNCH_VARIABLES]
    variables["additionalProperties"] = False
    return template


def ensure_pool(name: str) -> str:
    """The process work pool, created or brought to the template this worker's owner chose (an older stack's pool
    took any job variable)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from flows.config import ALLOW_LAUNCH_PARAMETERS

    allow = os.environ.get(ALLOW_LAUNCH_PARAMETERS) == "1"
    template = job_template(allow)
    which = "any job variable" if allow else f"no {'/'.join(LAUNCH_VARIABLES)} from callers"
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            return f"work pool {name}: created (process, {which})"
        if pool.base_job_template != template:
            client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
            return f"work pool {name}: template updated ({which})"
        return f"work pool {name}: exists ({which})"


def main() -> None:
    print(f"[stack] {ensure_experiment(os.environ.get('BATON_EXPERIMENT', 'baton'))}", flush=True)
    if "--pool" in sys.argv:
        print(f"[stack] {ensure_pool(sys.argv[sys.argv.index('--pool') + 1])}", flush=True)
        sys.path.insert(0, str(REPO / "infra" / "prefect"))
        import automations

        print(f"[stack] automation {automations.ensure(automations.crash_zombie_flows())}", flush=True)


if __name__ == "__main__":
    main()
