"""Bring your own mixture of experts to the serve stage: a Qwen3-MoE and a Mixtral built outside baton (random init
from transformers' own configs, save_pretrained, the data stage's tokenizer) go through `baton run --stages serve
--from <folder>` on vLLM's CPU build, the Qwen3-MoE on SGLang's too (its MoE layer's plain-torch CPU path; the Mixtral
on SGLang is tests/test_moe_chain.py's), and the stage's gate passes with greedy parity against HF generate; the
routing mismatch says why it is not measured. tests/test_moe_chain.py serves the Mixtral baton pretrained itself.
Smoke size (2 prompts × 8 tokens, 2 JSON requests, no lm-eval): `make test-long`."""
from __future__ import annotations

import json

import pytest

from conftest import TINY, baton
from test_moe import make_moe_checkpoint

# vLLM's CPU attention has kernels for head sizes 32, 64, 80, …: not test_moe's 16
SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
SMOKE = ["--set", "serve.smoke.json_requests=2", "--set", "serve.smoke.parity_prompts=2",
         "--set", "serve.smoke.parity_tokens=8", "--set", "serve.lm_eval.enabled=false"]


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, architecture, engine", [("qwen3_moe", "Qwen3MoeForCausalLM", "vllm"),
                                                          ("mixtral", "MixtralForCausalLM", "vllm"),
                                                          ("qwen3_moe", "Qwen3MoeForCausalLM", "sglang")])
def test_an_outside_built_moe_from_a_folder_is_served_with_greedy_parity(family, architecture, engine, tmp_path,
                                                                         baton_home, data_dir):
    ckpt = make_moe_checkpoint(tmp_path / family, family, data_dir / "tokenizer", **SHAPE)
    r = baton("run", str(TINY), "--stages", "serve", "--from", str(ckpt), "--set", f"serve.engine={engine}", *SMOKE,
              home=baton_home, timeout=800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((next((baton_home / "runs").iterdir()) / "summary.json").read_text())
    stages = {s["label"]: s for s in summary["stages"]}
    assert list(stages) == ["data", "serve"], list(stages)  # the data stage: the smoke checks' prompts
    serve = stages["serve"]
    assert serve["status"] == "completed" and serve["gate"]["passed"], serve["gate"]
    checks = {c["name"]: c for c in serve["gate"]["checks"]}
    assert checks["preflight.architectures"]["detail"] == f"config.json architectures=['{architecture}']"
    parity = checks[f"{engine}.smoke.greedy_parity"]
    assert parity["passed"] and parity["detail"].startswith("2 prompts x 8 tokens identical to HF"), parity
    # neither CPU build can return its routing: not measured, and the result says why
    routing = serve["routing_mismatch"][engine]
    assert routing["measured"] is False and routing["reason"] == "engine_cpu_build", routing
