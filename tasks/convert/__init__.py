from tasks.convert.config import ConvertConfig
from tasks.convert.preflight import check_input
from tasks.stage import StageRole, StageSpec

STAGE = StageSpec(
    name="convert",
    role=StageRole.CONVERT,
    config_model=ConvertConfig,
    task="tasks.convert.task:run_convert",
    consumes=lambda cfg: None,  # whatever its neighbour left; the pipeline sets from/to formats
    produces=lambda cfg: cfg.to_format,
    check_input=check_input,
    description="checkpoint format conversion with its own verification gate",
)
