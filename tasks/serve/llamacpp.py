"""llama.cpp as a serving engine: llama-server (the llamacpp runtime) on a GGUF export (`baton export`), proven right
as the HF engines are — /v1/models and 401 without the key, a chat completion rendered with the file's own chat
template (prompt tokens as HF's rendering of the source's template), and greedy token parity with HF generate on the
same weights: the GGUF's, dequantised into the source's architecture (conversions.gguf_export),
so a quantised file is compared with itself and only the engine is under test.

Not yet: the JSON-schema smoke. llama-server takes response_format json_schema (a grammar), but its chat route parses
the answer and fails the request (500, "does not match the expected peg-native format") when the text is not valid
UTF-8, which a random-init model's byte tokens inside a JSON string often are; its grammar also allows whitespace
between tokens, unlike the HF engines' flags.

What is left for the serve stage (`serve.engine: llamacpp`): it consumes an HF checkpoint, so it would export f16
first (the export stage) and promote the GGUF; today `check_gguf` is the engine's launch and gate, usable on any
export folder whose parent HF checkpoint is still there.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path

from conversions import gguf_export, manifest as mf
from conversions.verify import check, report
from tasks import runtimes
from tasks.serve import engines, smoke
from tasks.serve.config import ServeConfig
from tasks.serve.server import Server, ServerFailed, free_port, redactor

ENGINE = "llamacpp"


@dataclass
class Served:
    report: dict      # verify.report of the checks
    log: Path         # the server's (redacted) log


def source_of(export_dir: Path) -> Path:
    """The HF checkpoint an export folder was made from (its manifest's parent), which must still be there."""
    parent = Path(((mf.read(export_dir) or {}).get("parent") or {}).get("path") or "")
    if parent == Path("") or not (parent / "config.json").exists():
        raise gguf_export.ExportError(f"{export_dir}: its parent HF checkpoint {str(parent) or '(none recorded)'} is "
                                      "not here; llama-server's parity check needs its tokenizer and architecture")
    return parent


def gguf_model(gguf_file: Path, hf_dir: Path):
    """The GGUF file's weights in the source's architecture (fp32), as the export gate builds it."""
    from transformers import AutoConfig

    source = gguf_export._structure(gguf_file)[-1]["source"]
    return gguf_export.dequantised_model(source, gguf_file, AutoConfig.from_pretrained(str(hf_dir)))


def check_gguf(export_dir: Path, cfg: ServeConfig, work_dir: Path, runtime_specs: dict | None = None,
               hf_dir: Path | None = None) -> Served:
    """Serve export_dir/model.gguf with llama-server, run the checks, stop the server."""
    from transformers import AutoTokenizer

    from tasks.serve.reference import greedy_reference

    gguf_file = Path(export_dir) / gguf_export.GGUF_NAME
    hf_dir = hf_dir or source_of(export_dir)
    model = gguf_model(gguf_file, hf_dir)
    reference = greedy_reference(hf_dir, cfg.smoke.parity_prompts, cfg.smoke.parity_tokens, model=model)
    key, port = "baton-" + secrets.token_urlsafe(24), cfg.port or free_port()
    name = cfg.served_model_name or Path(export_dir).name
    cmd, env = engines.llamacpp_command(cfg, runtimes.python_for(engines.RUNTIME[ENGINE], runtime_specs), gguf_file,
                                        port, name, key)
    base_url = f"http://{cfg.host}:{port}"
    log = Path(work_dir) / f"server-{ENGINE}.log"
    server = Server(ENGINE, cmd, env, base_url, log, redactor(key))
    try:
        with server:
            server.wait_healthy(cfg.health_timeout_s)
            ep = smoke.Endpoint(ENGINE, base_url, key, name)
            tok = AutoTokenizer.from_pretrained(str(hf_dir))
            checks = [smoke.models(ep), smoke.unauthorized(ep), smoke.chat(ep, tok, cfg.smoke.max_tokens),
                      smoke.greedy_parity(ep, reference, hf_dir, model)]
    except ServerFailed as e:
        checks = [check("serve.healthy", False, str(e)[-2000:])]
    return Served(report(checks, {}), log)
