from conversions.manifest import Format
from tasks.pretrain.config import PretrainConfig, host_errors, validate
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="pretrain",
    trains=True,
    config_model=PretrainConfig,
    task="tasks.pretrain.task:run_pretrain",
    consumes=lambda cfg: Format.MEGATRON_DIST,
    produces=lambda cfg: Format.MEGATRON_DIST,
    input_required=False,
    validate=validate,
    validate_host=host_errors,
    description="Megatron-Core GPT pretraining (TP/PP/DP), distributed checkpoints, resume",
)
