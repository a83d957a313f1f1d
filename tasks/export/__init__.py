"""Exports: GGUF by llama.cpp's own converter in the llamacpp runtime (worker.py), gated by conversions.gguf_export;
quantized checkpoints for vLLM by llm-compressor in the llmcompressor runtime (quantize_worker.py), gated by
conversions.vllm_quant; nothing published before its gate passed. A relay stage (task.py: `export:` in a run config,
after finetune) and a command on any HF checkpoint (`baton export`, run.py and quantize.py)."""
from conversions import vllm_quant
from conversions.manifest import Format
from tasks.export.config import ExportConfig, is_quantization, moe_problem, moe_problem_of
from tasks.problems import ConfigProblem
from tasks.stage import StageSpec

KEY = "export.types"


def _runtimes(cfg: ExportConfig) -> set[str]:
    """The converters' runtimes; the gates read both files in the main runtime."""
    wanted = {"main"}
    wanted |= {"llmcompressor"} if any(map(is_quantization, cfg.types)) else set()
    wanted |= {"llamacpp"} if not all(map(is_quantization, cfg.types)) else set()
    return wanted


def _smoke(cfg: ExportConfig) -> dict:
    first = cfg.types[:1]
    return {"types": first, "max_logit_rms": {k: v for k, v in cfg.max_logit_rms.items() if k in first},
            "max_loss_delta": {k: v for k, v in cfg.max_loss_delta.items() if k in first}}


def _side_format(cfg: ExportConfig) -> str | None:
    """GGUF when a GGUF type is exported: the quantized vLLM folders are side outputs too, but of another format."""
    return None if all(map(is_quantization, cfg.types)) else Format.GGUF_FILE


def validate(cfg: ExportConfig, pipeline) -> list[ConfigProblem]:
    """A mixture of experts, or a grouped quantization type whose group does not divide the model section's widths,
    when the run trains that model (a run from --from is checked against the checkpoint's config.json: check_input)."""
    model = getattr(pipeline, "model", None)
    if model is None or "pretrain" not in pipeline.stages:
        return []
    if problem := moe_problem(model.moe.num_experts if model.moe else None, KEY):
        return [ConfigProblem(KEY, problem, involves=("model.moe",))]
    widths = {"model.hidden_size": model.hidden_size, "model.ffn_hidden_size": model.ffn_hidden_size}
    return [ConfigProblem(KEY, problem, involves=tuple(widths)) for t in cfg.types if is_quantization(t)
            if (problem := vllm_quant.group_problem(t, widths, KEY))]


def check_input(pipeline, step, config: dict, input_path) -> str | None:
    cfg = pipeline.stage_config(step.name)
    problems = [p for t in cfg.types if is_quantization(t)
                if (p := vllm_quant.group_problem(t, vllm_quant.input_widths(config), KEY))]
    return moe_problem_of(config, KEY) or (problems[0] if problems else None)


STAGE = StageSpec(
    name="export",
    config_model=ExportConfig,
    task="tasks.export.task:run_export",
    consumes=lambda cfg: Format.HF_SAFETENSORS,
    produces=lambda cfg: None,  # the GGUF files are side outputs: the next stage reads the HF checkpoint
    side_format=_side_format,  # a later stage that consumes GGUF gets the first GGUF type's file
    validate=validate,
    check_input=check_input,
    runtimes=_runtimes,
    smoke=_smoke,
    description="GGUF files for llama.cpp / Ollama (llama.cpp's converter) and quantized checkpoints for vLLM "
                "(llm-compressor), gated against the HF checkpoint",
)
