from conversions.manifest import Format
from tasks.data.config import DataConfig, validate
from tasks.stage import StageRole, StageSpec

STAGE = StageSpec(
    name="data",
    role=StageRole.DATA,
    config_model=DataConfig,
    task="tasks.data.task:run_data",
    consumes=lambda cfg: None,
    produces=lambda cfg: Format.DATASET,
    input_required=False,
    validate=validate,
    description="datasets in one canonical chat form (pretraining text, preference pairs, conversations) and a "
                "tokenizer (the input model's, or a new BPE with a chat template)",
)
