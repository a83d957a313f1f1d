"""Serve stage refusals: a checkpoint servers would get wrong is refused before any server starts, nothing promoted."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conversions import hf, manifest as mf
from tasks.serve.config import ServeConfig
from tasks.serve.task import serve
from tasks.stage import StageContext

REPO = Path(__file__).resolve().parent.parent


def _remanifest(ckpt):
    mf.write(ckpt, mf.build(ckpt, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(ckpt),
                            dtype="float32"))


def _ctx(tmp_path, ckpt, tiny_config) -> StageContext:
    work = tmp_path / "serve"
    return StageContext(stage="serve", run_id="test", run_dir=tmp_path, work_dir=work,
                        model=tiny_config.model.model_dump(), seed=0, input=ckpt, input_format="hf-safetensors",
                        tracking={"registered_model": "serve-refusal"})


def _assert_refused(out, ctx, check_name, words):
    assert not out.gate["passed"]
    failed = {c["name"]: c["detail"] for c in out.gate["checks"] if not c["passed"]}
    assert check_name in failed, failed
    for w in words:
        assert w in failed[check_name]
    assert out.extra["servers_started"] == 0
    assert out.extra.get("champion") is None
    assert not list(ctx.work_dir.glob("server-*.log")), "a server was started"
    assert not (ctx.work_dir / "api_key").exists()
    from tasks import tracking

    c = tracking.client()
    assert c.search_registered_models("name = 'serve-refusal'") == []  # nothing registered, nothing promoted


def test_no_chat_template_is_refused(tmp_path, baton_home, hf_checkpoint, tiny_config):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, ckpt)
    (ckpt / "chat_template.jinja").unlink()
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    _remanifest(ckpt)
    ctx = _ctx(tmp_path, ckpt, tiny_config)
    t0 = time.time()
    out = serve(ctx, ServeConfig())
    _assert_refused(out, ctx, "preflight.chat_template", ["no chat template"])
    assert time.time() - t0 < 60


def test_tied_config_with_different_lm_head_is_refused(tmp_path, baton_home, hf_checkpoint, tiny_config):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["tie_word_embeddings"] = True  # the weights keep their own, different lm_head
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _remanifest(ckpt)
    ctx = _ctx(tmp_path, ckpt, tiny_config)
    out = serve(ctx, ServeConfig())
    _assert_refused(out, ctx, "preflight.tied_embeddings", ["tie_word_embeddings=true", "differs"])


def test_corrupted_weights_are_refused(tmp_path, baton_home, hf_checkpoint, tiny_config):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint, ckpt)
    shard = next(ckpt.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the weights
    shard.write_bytes(bytes(data))
    ctx = _ctx(tmp_path, ckpt, tiny_config)
    out = serve(ctx, ServeConfig())
    _assert_refused(out, ctx, "L0.integrity", ["sha256 mismatch"])


@pytest.mark.parametrize("override, message", [
    ("serve.max_model_len=4096", "exceeds model.seq_length"),
    ("serve.engine=tgi", "serve.engine"),
    ("serve.api_key_file=/nonexistent/key", "no such file"),
])
def test_bad_serve_config_fails_before_launch(override, message):
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load(REPO / "configs" / "tiny.yaml", [override])


@pytest.mark.fast
def test_vllm_cpu_head_dim_16_is_refused_before_any_server(tmp_path, baton_home, tiny_config, data_dir):
    """vLLM's CPU attention has no kernel for head_dim 16: the server would start, then crash. Refused first."""
    from conftest import make_hf_checkpoint

    arch = dict(tiny_config.model.model_dump(), num_layers=1, hidden_size=64, num_attention_heads=4)
    ckpt = make_hf_checkpoint(tmp_path / "ckpt", arch, data_dir / "tokenizer")
    _remanifest(ckpt)
    ctx = _ctx(tmp_path, ckpt, tiny_config)
    out = serve(ctx, ServeConfig(engine="vllm"))
    _assert_refused(out, ctx, "preflight.vllm_cpu_head_dim",
                    ["head_dim 16 (config.json head_dim)", "32, 64, 80"])


@pytest.mark.fast
def test_the_head_dim_rule_applies_to_vllm_on_cpu_only():
    from tasks.serve.engines import vllm_cpu_head_dim_problem

    small = {"hidden_size": 64, "num_attention_heads": 4}
    assert "head_dim 16" in vllm_cpu_head_dim_problem(ServeConfig(engine="both"), small)
    assert vllm_cpu_head_dim_problem(ServeConfig(engine="sglang"), small) is None
    assert vllm_cpu_head_dim_problem(ServeConfig(engine="vllm", device="cuda"), small) is None
    assert vllm_cpu_head_dim_problem(ServeConfig(engine="vllm"), {**small, "head_dim": 32}) is None
    explicit = vllm_cpu_head_dim_problem(ServeConfig(engine="vllm"), {"hidden_size": 256, "num_attention_heads": 4,
                                                                      "head_dim": 48})
    assert "head_dim 48 (config.json head_dim)" in explicit
    nested = {"text_config": {"hidden_size": 64, "num_attention_heads": 4}}
    derived = vllm_cpu_head_dim_problem(ServeConfig(engine="vllm"), nested)
    assert "head_dim 16 (hidden_size 64 / num_attention_heads 4)" in derived


@pytest.mark.fast
def test_a_config_that_pretrains_a_head_dim_vllm_cpu_cannot_serve_is_refused_when_it_loads():
    from flows.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(REPO / "configs" / "tiny.yaml", ["model.hidden_size=64"])
    assert ("serve.engine both on serve.device cpu: the model section's head_dim 16 (hidden_size 64 / "
            "num_attention_heads 4)") in str(e.value)
    load(REPO / "configs" / "tiny.yaml", ["model.hidden_size=64", "serve.engine=sglang"])
    load(REPO / "configs" / "tiny.yaml", ["model.hidden_size=64"], stages=["rlhf", "serve"])  # the model comes --from


@pytest.mark.fast
def test_the_supported_head_sizes_are_vllms_own():
    """The list baton refuses by is the one in the built vLLM runtime's CPU attention backend (read, not imported)."""
    import ast

    from tasks.runtimes import runtime_dir
    from tasks.serve.engines import VLLM_CPU_HEAD_SIZES

    found = sorted(runtime_dir("vllm").glob("lib/python*/site-packages/vllm/v1/attention/backends/cpu_attn.py"))
    if not found:
        pytest.skip("the vllm runtime is not built (make runtimes)")
    tree = ast.parse(found[0].read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "get_supported_head_sizes")
    returned = next(n for n in ast.walk(fn) if isinstance(n, ast.Return))
    assert tuple(ast.literal_eval(returned.value)) == VLLM_CPU_HEAD_SIZES


@pytest.mark.slow  # the CLI in a subprocess (no engine): kept out of the fast loop's budget
def test_a_run_that_would_serve_head_dim_16_on_vllm_cpu_is_refused_before_its_first_stage(tmp_path, baton_home,
                                                                                           tiny_config, data_dir):
    from conftest import TINY, baton, make_hf_checkpoint

    arch = dict(tiny_config.model.model_dump(), num_layers=1, hidden_size=64, num_attention_heads=4)
    ckpt = make_hf_checkpoint(tmp_path / "ckpt", arch, data_dir / "tokenizer")
    _remanifest(ckpt)
    r = baton("run", str(TINY), "--stages", "finetune,serve", "--set", "serve.engine=vllm", "--from", str(ckpt),
              home=baton_home, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "serve.engine vllm on serve.device cpu: head_dim 16" in r.stderr, r.stderr[-2000:]
    assert not (baton_home / "runs").exists()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_mixtures_routing_mismatch_says_why_it_is_not_measured(tmp_path, engine, device):
    """Neither pinned engine returns its routing on CPU (each server fails to start with the option, tried by hand):
    the serve result of a mixture of experts says so with an enum reason, not a share of 0; a dense model has no
    entry."""
    from transformers import LlamaConfig, MixtralConfig

    from tasks.serve.routing import RoutingUnavailable, routing_mismatch

    MixtralConfig(num_local_experts=4, num_experts_per_tok=2).save_pretrained(str(tmp_path / "moe"))
    LlamaConfig().save_pretrained(str(tmp_path / "dense"))
    found = routing_mismatch(engine, device, tmp_path / "moe")
    expected = RoutingUnavailable.ENGINE_CPU_BUILD if device == "cpu" else RoutingUnavailable.NOT_REQUESTED
    assert found["measured"] is False and found["share"] is None and found["reason"] == expected.value, found
    assert routing_mismatch(engine, device, tmp_path / "dense") is None
