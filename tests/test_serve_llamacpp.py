"""llama.cpp as a serving engine inside the serve stage (`serve.engine: llamacpp`, tasks/serve/llamacpp.py): the
export stage writes the tiny model's q4_K_M GGUF beside the relay, the serve stage reads that file (the relay hands it the
side output of the format it consumes) and proves llama-server right with the HF engines' checks: models, 401 without
the key, a chat rendered with the GGUF's own template, that rendering token for token, the stop at the end of a turn,
greedy parity with HF on the GGUF's own weights (within the type's tolerance, HF fed the server's tokens), JSON-schema
answers (response_format), lm-eval through the server. Where it cannot apply, the run is refused before anything
launches, naming the key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, baton
from conversions.gguf_export import TYPES

DATA = ("--set", "data.pretrain_docs=200", "--set", "data.preference_pairs=40", "--set", "data.sft_examples=60")
CHECKS = {"L0.integrity", "preflight.gguf_source", "preflight.runtimes", "llamacpp.server", "llamacpp.smoke.models",
          "llamacpp.smoke.auth_401", "llamacpp.smoke.chat", "llamacpp.smoke.chat_template_parity",
          "llamacpp.smoke.stops_at_end_of_turn", "llamacpp.smoke.json_schema", "llamacpp.smoke.greedy_parity",
          "promotion.lm_eval"}


def test_the_serve_stage_serves_the_exported_gguf_with_llama_server(baton_home, hf_checkpoint):
    r = baton("run", str(TINY), "--from", str(hf_checkpoint), "--stages", "export,serve", *DATA,
              "--set", "export.types=[q4_K_M]", "--set", "serve.engine=llamacpp", "--set", "serve.health_timeout_s=120",
              "--set", "serve.smoke.parity_prompts=2", "--set", "serve.smoke.parity_tokens=16",
              "--set", "serve.smoke.json_requests=10", "--set", "serve.lm_eval.limit=4", home=baton_home, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    export, serve = (next(e for e in summary["stages"] if e["name"] == n) for n in ("export", "serve"))
    gguf = export["side_outputs"]["q4_K_M"]["output"]
    assert export["metrics"]["q4_k_m_logit_rms"] < 0.3, export["metrics"]  # metric names are lower case
    assert serve["status"] == "completed" and serve["served_checkpoint"] == gguf, serve
    checks = {c["name"]: c for c in serve["gate"]["checks"]}
    assert set(checks) == CHECKS, sorted(checks)
    # q4_K_M: llama.cpp quantises the activations too, so parity is the type's tolerance, HF fed the server's tokens
    tolerance = TYPES["q4_K_M"].served_logit_gap
    assert f"2 prompts x 16 server tokens, HF (fp32) fed them: each within {tolerance:g}" in \
        checks["llamacpp.smoke.greedy_parity"]["detail"], checks["llamacpp.smoke.greedy_parity"]
    assert checks["llamacpp.smoke.json_schema"]["detail"].startswith("10/10 strictly valid"), checks
    assert serve["metrics"]["json_valid_rate"] == 1.0, serve["metrics"]
    assert serve["metrics"]["llamacpp_tokens_per_s"] > 0 and "lm_eval_wall_s" in serve["metrics"], serve["metrics"]
    champion = serve["champion"]
    assert champion["name"] == "baton-tiny-gguf-file", champion  # a version of the GGUF's own registered model


@pytest.mark.fast
def test_llamacpp_without_a_gguf_upstream_is_refused_naming_the_key():
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"serve\.engine llamacpp serves a gguf-file checkpoint, and no stage listed "
                                          r"before serve writes one .*\(export\) before serve"):
        load(TINY, ["serve.engine=llamacpp", "stages=[data,pretrain,rlhf,finetune,serve]"])
    with pytest.raises(ConfigError, match=r"serve\.device cuda: serve\.engine llamacpp"):
        load(TINY, ["serve.engine=llamacpp", "serve.device=cuda"])


@pytest.mark.fast
def test_the_planner_hands_llamacpp_the_export_side_output_and_vllm_the_relay():
    from flows import chain_planner
    from flows.config import load

    for engine, consumes, side_of in (("llamacpp", "gguf-file", "export"), ("vllm", "hf-safetensors", None)):
        steps = chain_planner.plan(load(TINY, [f"serve.engine={engine}"]))
        serve, export = (next(s for s in steps if s.name == n) for n in ("serve", "export"))
        assert (serve.consumes, serve.reads_side_of) == (consumes, side_of), serve
        assert serve.input_fingerprint == (export.fingerprint if side_of else export.input_fingerprint)
        assert not any(s.name == "convert" and s.produces == "gguf-file" for s in steps)


@pytest.mark.fast
def test_a_format_the_engine_does_not_serve_is_refused_by_the_serve_preflight(hf_checkpoint):
    from tasks.serve.config import ServeConfig
    from tasks.serve.task import preflight

    failed = [c for c in preflight(hf_checkpoint, ServeConfig(engine="llamacpp")) if not c["passed"]]
    assert [c["name"] for c in failed] == ["preflight.format"], failed
    assert "serve.engine llamacpp serves gguf-file" in failed[0]["detail"] and "baton export" in failed[0]["detail"]
