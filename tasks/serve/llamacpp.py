"""llama.cpp as a serving engine (`serve.engine: llamacpp`): llama-server (the llamacpp runtime) on a GGUF export
folder, proven right as the HF engines are. The serve stage runs it on the GGUF an earlier stage exported (the relay
hands it the first side output of that format) or on a GGUF folder given with --from; `check_gguf` is the same launch
and checks outside a pipeline. The checks: /v1/models and 401 without the key, a chat completion rendered with the
file's own chat template (prompt tokens as HF's rendering of the source's template, the rendering token for token, the
stop at the end of a turn), and greedy token parity with HF on the same weights: the GGUF's, dequantised into the
source's architecture (conversions.gguf_export), so a quantised file is compared with itself and only the engine is
under test (what quantising cost is the export gate's question, answered before this file was published). Parity is
token for token on f16; on a quantised type llama.cpp quantises the activations too, so each of its greedy tokens must
instead be within the type's served_logit_gap of HF's largest logit, HF fed the server's tokens.

The serve stage also asks it for JSON-schema answers (OpenAI response_format json_schema, which llama-server turns
into a grammar), with the free string narrowed to ASCII letters and twice the tokens (tasks.serve.smoke.JSON_REQUEST:
why). Not checked: regex answers (llama-server takes no regex, only GBNF grammars), and the sampling defaults
(llama-server applies its own, not generation_config.json's); nor, by check_gguf, the JSON answers.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from conversions import gguf_export, manifest as mf
from conversions.verify import check, report
from tasks import runtimes
from tasks.serve import engines, smoke
from tasks.serve.config import ServeConfig
from tasks.serve.server import Server, ServerFailed, free_port, redactor

ENGINE = "llamacpp"


@dataclass
class Source:
    """What a GGUF file is proven against: its HF parent (tokenizer, template, architecture) and the file's own
    weights in that architecture."""
    hf_dir: Path
    model: object  # a transformers model, fp32
    tolerance: float | None = None  # greedy parity's (gguf_export.ExportType.served_logit_gap); None: exact


def parity_tolerance(export_dir: Path) -> float | None:
    """The greedy parity tolerance of the file's GGUF type (its manifest's); exact equality for f16 or a type not
    recorded."""
    type_name = ((mf.read(export_dir) or {}).get("extra") or {}).get("gguf_type")
    kind = gguf_export.TYPES.get(type_name)
    return kind.served_logit_gap if kind else None


@dataclass
class Served:
    report: dict      # verify.report of the checks
    log: Path         # the server's (redacted) log
    metrics: dict = field(default_factory=dict)  # smoke.performance of the live server (empty when it never started)
    probed: object = None  # what `probe` returned


def source_of(export_dir: Path) -> Path:
    """The HF checkpoint an export folder was made from (its manifest's parent), which must still be there."""
    parent = Path(((mf.read(export_dir) or {}).get("parent") or {}).get("path") or "")
    if parent == Path("") or not (parent / "config.json").exists():
        raise gguf_export.ExportError(f"{export_dir}: its parent HF checkpoint {str(parent) or '(none recorded)'} is "
                                      "not here; llama-server's parity check needs its tokenizer and architecture")
    return parent


def preflight(export_dir: Path) -> list[dict]:
    """Before llama-server starts: the folder holds a GGUF file whose HF parent is still here."""
    gguf_file = Path(export_dir) / gguf_export.GGUF_NAME
    if not gguf_file.is_file():
        return [check("preflight.gguf", False, f"{gguf_file}: missing")]
    try:
        parent = source_of(export_dir)
    except gguf_export.ExportError as e:
        return [check("preflight.gguf_source", False, str(e))]
    return [check("preflight.gguf_source", True, f"{gguf_file.name} of {(mf.read(export_dir) or {}).get('dtype')}, "
                                                 f"proven against its HF parent {parent}")]


def source(export_dir: Path) -> Source:
    hf_dir = source_of(export_dir)
    return Source(hf_dir, gguf_model(Path(export_dir) / gguf_export.GGUF_NAME, hf_dir), parity_tolerance(export_dir))


def gguf_model(gguf_file: Path, hf_dir: Path):
    """The GGUF file's weights in the source's architecture (fp32), as the export gate builds it."""
    from transformers import AutoConfig

    source = gguf_export._structure(gguf_file)[-1]["source"]
    return gguf_export.dequantised_model(source, gguf_file, AutoConfig.from_pretrained(str(hf_dir)))


def check_gguf(export_dir: Path, cfg: ServeConfig, work_dir: Path, runtime_specs: dict | None = None,
               hf_dir: Path | None = None, probe=None) -> Served:
    """Serve export_dir/model.gguf with llama-server, run the checks and the decode benchmark, then `probe(endpoint)`
    when given, stop the server (outside a pipeline: the benchmarks and the real-model lane)."""
    from transformers import AutoTokenizer

    from tasks.serve.reference import greedy_reference

    hf_dir = hf_dir or source_of(export_dir)
    model = gguf_model(Path(export_dir) / gguf_export.GGUF_NAME, hf_dir)
    reference = greedy_reference(hf_dir, cfg.smoke.parity_prompts, cfg.smoke.parity_tokens, model=model)
    key, port = "baton-" + secrets.token_urlsafe(24), cfg.port or free_port()
    name = cfg.served_model_name or Path(export_dir).name
    cmd, env = engines.llamacpp_command(cfg, runtimes.python_for(engines.RUNTIME[ENGINE], runtime_specs),
                                        Path(export_dir), port, name, key)
    base_url = f"http://{cfg.host}:{port}"
    log = Path(work_dir) / f"server-{ENGINE}.log"
    server = Server(ENGINE, cmd, env, base_url, log, redactor(key))
    try:
        with server:
            server.wait_healthy(cfg.health_timeout_s)
            ep = smoke.Endpoint(ENGINE, base_url, key, name)
            tok = AutoTokenizer.from_pretrained(str(hf_dir))
            stop_ids = mf.serving_contract(hf_dir).get("stop_token_ids") or [tok.eos_token_id]
            checks = smoke.endpoint_checks(ep, tok, cfg.smoke.max_tokens) + [
                smoke.guarded("smoke.greedy_parity", smoke.greedy_parity, ep, reference, hf_dir, model, stop_ids,
                              parity_tolerance(export_dir))]
            metrics = smoke.performance(ep)
            probed = probe(ep) if probe else None
    except ServerFailed as e:
        return Served(report([check("serve.healthy", False, str(e)[-2000:])], {}), log)
    return Served(report(checks, {}), log, metrics, probed)
