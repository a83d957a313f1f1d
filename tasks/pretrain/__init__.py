from conversions.manifest import Format
from tasks.pretrain.config import PretrainConfig, expert_errors, host_errors, validate
from tasks.memory_model import MemoryModel, Parallelism
from tasks.stage import StageSpec


def layout_keys(layout) -> dict:
    """A planned layout as this stage's config keys."""
    keys = {"tensor_parallel": layout.tp, "pipeline_parallel": layout.pp, "expert_parallel": layout.ep,
            "sequence_parallel": layout.sequence_parallel,
            "distributed_optimizer": layout.distributed_optimizer, "recompute_granularity": layout.recompute}
    if layout.etp is not None:
        keys["expert_tensor_parallel"] = layout.etp
    return keys


STAGE = StageSpec(
    name="pretrain",
    trains=True,
    memory=MemoryModel("megatron", Parallelism.MEGATRON, config_keys=layout_keys),
    config_model=PretrainConfig,
    task="tasks.pretrain.task:run_pretrain",
    consumes=lambda cfg: Format.MEGATRON_DIST,
    produces=lambda cfg: Format.MEGATRON_DIST,
    input_required=False,
    validate=validate,
    validate_host=host_errors,
    validate_layout=lambda cfg, pipeline: expert_errors(cfg, pipeline.model),
    smoke=lambda cfg: {"tensor_parallel": 1, "pipeline_parallel": 1, "sequence_parallel": False,
                       "distributed_optimizer": False, "overlap_param_gather": False, "overlap_grad_reduce": False,
                       "eval_interval": cfg.steps, "eval_iters": 1},
    batch_probe="tasks.pretrain.batch_probe:probe",
    runtime_needs=(("psutil", "which Megatron-Core needs to save checkpoints (it raises, then the other ranks hang)"),),
    description="Megatron-Core GPT pretraining (TP/PP/DP), distributed checkpoints, resume",
)
