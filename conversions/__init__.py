"""Checkpoint formats, manifests and verification. A pure library: no Prefect, no MLflow.

Workers (the programs that run inside an engine's runtime) import this package and the engine's own libraries only.
"""
