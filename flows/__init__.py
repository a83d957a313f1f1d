"""Prefect flows and the code they run on: the pipeline, one deployable flow per stage (stage_flows), retraining, and
the step runner each planned step runs in; the config model, the chain planner, the run index, reports, lineage, hub
inputs and smoke runs. The `baton` command is flows/cli/."""
