from tasks.pretrain.config import PretrainConfig, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="pretrain",
    config_model=PretrainConfig,
    task="tasks.pretrain.task:run_pretrain",
    consumes=lambda cfg: "megatron-dist",
    produces=lambda cfg: "megatron-dist",
    input_required=False,
    validate=validate,
    description="Megatron-Core GPT pretraining (TP/PP/DP), distributed checkpoints, resume",
)
