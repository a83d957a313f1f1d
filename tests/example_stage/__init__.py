"""A stage defined outside baton, the way docs/architecture.md ("How to add a stage") says: a package whose STAGE is a
StageSpec, registered by naming the package in BATON_STAGES. It runs right after the data stage and checks that each
dataset has at least `example.min_rows` training rows, reporting the counts as its metrics."""
from pydantic import Field

from tasks.stage import StageSpec, StrictModel


class ExampleConfig(StrictModel):
    min_rows: int = Field(1, ge=0, description="the fewest training rows each dataset must have")


STAGE = StageSpec(
    name="example",
    after="data",                                   # its place in the chain order
    config_model=ExampleConfig,                     # its section of a run config: `example: {min_rows: 10}`
    task="example_stage.task:run_example",          # imported only when the stage runs
    consumes=lambda cfg: None,                      # reads no checkpoint ...
    produces=lambda cfg: None,                      # ... and writes none: the chain passes through it
    input_required=False,
    description="counts the data stage's training rows (an example plug-in stage)",
)
