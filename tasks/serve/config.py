from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from conversions.probe import DTYPE_OF_PRECISION
from tasks import paths
from tasks.stage import StrictModel


class SmokeConfig(StrictModel):
    """Checks run against the live server before anything is promoted."""

    json_requests: int = Field(20, ge=1, description="JSON-schema requests; every answer must parse and validate")
    parity_prompts: int = Field(4, ge=1, description="prompts whose greedy token ids must equal HF generate")
    parity_tokens: int = Field(16, ge=1, description="greedy tokens compared per parity prompt")
    max_tokens: int = Field(48, ge=8, description="cap for chat / JSON / regex answers (llama.cpp's JSON answers: twice "
                                                  "this, its grammar allows runs of whitespace)")
    sgl_programs: int = Field(4, ge=1, description="SGLang: frontend programs (a select and a regex-constrained gen) "
                                                   "run as one batch")


class LmEvalConfig(StrictModel):
    """lm-evaluation-harness against the live server (model local-chat-completions)."""

    renamed: ClassVar[dict[str, str]] = {"timeout": "timeout_s"}

    enabled: bool = Field(True, description="score the held-out task through the live server")
    tasks: list[str] = Field(default_factory=list,
                             description="lm-eval task names; empty: the data stage's held-out SFT task")
    include_path: Path | None = Field(None, description="folder with extra lm-eval task YAMLs",
                                      json_schema_extra=paths.contents(paths.Contents.FOLDER))
    limit: int | None = Field(None, ge=1, description="evaluate at most this many documents per task")
    min_score: float = Field(0.0, ge=0.0, le=1.0, description="promotion needs exact_match >= this")
    no_regression: bool = Field(False, description="promotion also needs a score >= the current champion's")
    timeout_s: float = Field(900, gt=0, description="wall-clock limit of lm-eval")
    num_concurrent: int = Field(2, ge=1, description="requests lm-eval keeps in flight to the server")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Flags baton sets itself, or that would undo what it checks: where the server listens, whether the checkpoint's own
# Python runs, and option files that could set any of these (an --api-key is refused as a secret on a command line).
REFUSED_FLAGS = {
    "--host": "is set by serve.host (and serve.allow_remote)",
    "--port": "is chosen by baton (a free loopback port it health-checks)",
    "--trust-remote-code": "would run Python shipped inside the checkpoint; baton serves only known architectures",
    "--config": "would read any of these from a file",
    "--uds": "would move the server off the port baton checks",
}


def _refused_flag(arg: str) -> str | None:
    """The refused flag this argument spells (None when none): with '_' for '-', or abbreviated as argparse allows."""
    if not arg.startswith("--") or len(arg) < 4:
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    return next((flag for flag in REFUSED_FLAGS if flag.startswith(name)), None)


class ServeConfig(StrictModel):
    """Serve the input HF checkpoint with vLLM and/or SGLang, smoke-test it, and promote it to `champion`."""

    renamed: ClassVar[dict[str, str]] = {"dtype": "precision", "health_timeout": "health_timeout_s",
                                         "tensor_parallel_size": "tensor_parallel"}

    engine: Literal["vllm", "sglang", "both", "llamacpp"] = Field(
        "both", description="vllm, sglang, or both one at a time (an HF checkpoint); llamacpp: llama-server on the "
                            "GGUF file an earlier stage exported (its first type), or on a GGUF folder from --from")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu: the CPU runtimes and flags; cuda: GPU images")
    host: str = Field("127.0.0.1", description="address the server listens on; other than loopback needs allow_remote")
    allow_remote: bool = Field(False, description="let serve.host be reachable from other machines (API key only)")
    port: int = Field(0, ge=0, le=65535, description="0: pick a free port")
    api_key_file: Path | None = Field(None, description="file holding the API key; unset: generate one (0600)")
    served_model_name: str | None = Field(None, description="unset: <registered name>:<version>, else the folder name")
    max_model_len: int | None = Field(None, ge=16, description="unset: the checkpoint's max_position_embeddings")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "fp32", description="weights and activations on the server; auto: the checkpoint's own dtype")
    tensor_parallel: int = Field(1, ge=1, description="GPUs one server shards the model over")
    engine_args: dict[Literal["vllm", "sglang", "llamacpp"], list[str]] = Field(
        default_factory=dict, description="extra command-line flags per engine, appended last")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="cuda: fraction of GPU memory the server may take (vLLM "
        "--gpu-memory-utilization, SGLang --mem-fraction-static); unset: the engine's default. Keep it in 0.5-0.9")
    prompt_logprobs: int = Field(
        0, ge=0, description="vLLM: prompt log-probs per prompt token on chat requests (0: off); each request then "
        "holds vocabulary × prompt-token logits, a common OOM")
    kv_cache_gib: int = Field(1, ge=1, description="vLLM CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    sglang_grammar_backend: Literal["llguidance", "xgrammar"] = Field(
        "llguidance", description="llguidance + disable-any-whitespace gives strictly valid JSON on CPU")
    health_timeout_s: float = Field(600, gt=0, description="seconds to wait for /health")
    keep_alive: bool = Field(False, description="leave the (last) server running after the stage")
    restarts: int = Field(2, ge=0, description="`baton serve`: times the engine is restarted after it dies, before "
                                               "giving up (and rolling back the champion it promoted)")
    promote: bool = Field(True, description="move the registry alias `champion` when every check passes")
    smoke: SmokeConfig = SmokeConfig()
    lm_eval: LmEvalConfig = LmEvalConfig()

    @model_validator(mode="after")
    def _loopback_unless_allowed(self):
        if not self.allow_remote and not _loopback(self.host):
            raise ValueError(f"serve.host {self.host!r} is reachable from other machines; set serve.allow_remote: "
                             "true to mean it (the API key is then the only protection)")
        for engine, args in self.engine_args.items():  # appended last: a flag there would win over baton's own
            refused = sorted({flag for flag in map(_refused_flag, args) if flag}, key=list(REFUSED_FLAGS).index)
            if refused:
                raise ValueError(f"serve.engine_args.{engine}: "
                                 + "; ".join(f"{flag} {REFUSED_FLAGS[flag]}" for flag in refused) + ", not by extra flags")
        return self

    def engine_dtype(self) -> str:
        """The dtype name the engines take (--dtype)."""
        return DTYPE_OF_PRECISION.get(self.precision, self.precision)

    def engines(self) -> list[str]:
        return ["vllm", "sglang"] if self.engine == "both" else [self.engine]

    def input_format(self) -> str:
        """The checkpoint format the chosen engine serves."""
        from conversions.manifest import Format

        return Format.GGUF_FILE if self.engine == "llamacpp" else Format.HF_SAFETENSORS
