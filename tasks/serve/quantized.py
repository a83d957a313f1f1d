"""vLLM on a quantized export (`baton export --type w8a8|w4a16`, a compressed-tensors folder): refused before any
server starts when vLLM's CPU build has no kernel for its scheme (tasks.serve.engines, naming the scheme and the GPU
recipe), else served and checked as the HF engines are — /v1/models, 401 without the key, a chat completion — and a
greedy smoke: the same greedy continuation twice, its agreement with the unquantized parent's HF generate reported
(not required: quantization may change a greedy pick), and the decode speed.

Like llama.cpp's check_gguf, this is the engine's launch and gate on any quantized export folder whose parent HF
checkpoint is still there; the serve stage itself serves the relay's HF checkpoint."""
from __future__ import annotations

import json
import secrets
from pathlib import Path

from conversions.verify import check, report
from tasks import runtimes
from tasks.serve import engines, smoke
from tasks.serve.config import ServeConfig
from tasks.serve.llamacpp import Served, source_of
from tasks.serve.server import Server, ServerFailed, free_port, redactor

ENGINE = "vllm"


def check_quantized(export_dir: Path, cfg: ServeConfig, work_dir: Path, runtime_specs: dict | None = None) -> Served:
    """Serve export_dir with vLLM, run the checks, stop the server; or refuse before launch (no server, no log)."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    log = Path(work_dir) / f"server-{ENGINE}.log"
    if problem := engines.vllm_cpu_quantization_problem(cfg, config):
        return Served(report([check("preflight.vllm_cpu_quantization", False, problem)], {}), log)
    key, port = "baton-" + secrets.token_urlsafe(24), cfg.port or free_port()
    name = cfg.served_model_name or Path(export_dir).name
    cmd, env = engines.vllm_command(cfg, runtimes.python_for(engines.RUNTIME[ENGINE], runtime_specs),
                                    Path(export_dir), port, name, key)
    base_url = f"http://{cfg.host}:{port}"
    server = Server(ENGINE, cmd, env, base_url, log, redactor(key))
    try:
        with server:
            server.wait_healthy(cfg.health_timeout_s)
            checks = served_checks(smoke.Endpoint(ENGINE, base_url, key, name), Path(export_dir), cfg)
    except ServerFailed as e:
        checks = [check("serve.healthy", False, str(e)[-2000:])]
    return Served(report(checks, {}), log)


def served_checks(ep: smoke.Endpoint, export_dir: Path, cfg: ServeConfig) -> list[dict]:
    from transformers import AutoTokenizer

    from tasks.serve.reference import greedy_reference

    parent = source_of(export_dir)
    reference = greedy_reference(parent, cfg.smoke.parity_prompts, cfg.smoke.parity_tokens)
    tok = AutoTokenizer.from_pretrained(str(export_dir))
    checks = smoke.endpoint_checks(ep, tok, cfg.smoke.max_tokens)
    return checks + [smoke.guarded("smoke.greedy", greedy_smoke, ep, reference)]


def greedy_smoke(ep: smoke.Endpoint, reference: list[dict]) -> dict:
    """Each prompt's greedy continuation, asked twice: as long as asked and the same both times. Its agreement with the
    parent's HF generate and the decode speed are reported in the detail."""
    n_tokens = len(reference[0]["output_ids"])
    agree, total = 0, 0
    for ref in reference:
        first, again = (smoke.greedy_ids(ep, ref["prompt_ids"], n_tokens) for _ in range(2))
        if len(first) != n_tokens or first != again:
            return check("smoke.greedy", False, f"{ref['instruction']!r}: {len(first)} tokens of {n_tokens}, "
                                                f"then {again[:8]} after {first[:8]}")
        agree += smoke.first_difference(first, ref["output_ids"])
        total += n_tokens
    speed = smoke.performance(ep)
    return {**check("smoke.greedy", True,
                    f"{len(reference)} prompts x {n_tokens} tokens, the same twice; {agree}/{total} tokens before the "
                    f"first difference from the unquantized parent's HF generate; {speed['tokens_per_s']:.1f} "
                    "tokens/s decode"),
            "agreeing_prefix": agree, "tokens": total, "tokens_per_s": speed["tokens_per_s"]}
