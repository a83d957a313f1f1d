from tasks.pretrain.config import PretrainConfig, host_errors, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="pretrain",
    trains=True,
    config_model=PretrainConfig,
    task="tasks.pretrain.task:run_pretrain",
    consumes=lambda cfg: "megatron-dist",
    produces=lambda cfg: "megatron-dist",
    input_required=False,
    validate=validate,
    validate_host=host_errors,
    description="Megatron-Core GPT pretraining (TP/PP/DP), distributed checkpoints, resume",
)
