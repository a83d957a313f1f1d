"""infra/compose/compose.yaml keeps its secrets off command lines: what a container runs is shown by `ps` to every user
of the host (and by `docker inspect`), its environment is not. The MLflow store URI (holding the database password) and
MinIO's keys for the bucket job come through the environment."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import REPO

pytestmark = pytest.mark.fast
COMPOSE = REPO / "infra" / "compose"


def _secrets() -> list[str]:
    """The secret settings `.env` holds (their names, as compose interpolates them)."""
    names = re.findall(r"^([A-Z_]+)=", (COMPOSE / ".env.example").read_text(), re.M)
    return [n for n in names if re.search(r"PASSWORD|SECRET|TOKEN|KEY", n)]


def test_no_secret_reaches_a_command_line():
    services = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    secrets = _secrets()
    assert "POSTGRES_PASSWORD" in secrets and "MINIO_ROOT_PASSWORD" in secrets
    for name, service in services.items():
        for field in ("command", "entrypoint", "healthcheck"):
            text = json.dumps(service.get(field, ""))
            assert not [s for s in secrets if s in text], f"{name}.{field} puts a secret on a command line: {text}"
            assert not re.search(r"://[^/\s@]+:[^/\s@]+@", text), f"{name}.{field}: credentials in a URL: {text}"
    mlflow_env = services["mlflow"]["environment"]
    assert "${POSTGRES_PASSWORD}@postgres:5432/mlflow" in mlflow_env["MLFLOW_BACKEND_STORE_URI"]
