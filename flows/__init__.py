"""Prefect flows: the composite pipeline, one flow per stage, retraining, the pipeline config model and the CLI."""
