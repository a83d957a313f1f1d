from tasks.data.config import DataConfig
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="data",
    config_model=DataConfig,
    task="tasks.data.task:run_data",
    consumes=lambda cfg: None,
    produces=lambda cfg: "dataset",
    input_required=False,
    description="datasets (pretraining text, preference pairs, instruction→JSON) and a BPE tokenizer with chat template",
)
