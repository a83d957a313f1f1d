from conversions.manifest import Format
from tasks.rlhf.checks import host_errors, validate
from tasks.rlhf.config import RlhfConfig
from tasks.stage import StageSpec

STAGE = StageSpec(
    name="rlhf",
    trains=True,
    config_model=RlhfConfig,
    task="tasks.rlhf.task:run_rlhf",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: Format.HF_SAFETENSORS,
    validate=validate,
    validate_host=host_errors,
    description="preference optimisation: NeMo-RL on GPU clusters, TRL on CPU",
)
