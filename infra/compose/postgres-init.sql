-- The compose stack's second database (the first, prefect, is POSTGRES_DB). Runs once, on an empty volume.
CREATE DATABASE mlflow OWNER baton;
