"""Prefect tasks, one folder per stage, plus the shared plumbing: launching engines and MLflow tracking."""
