"""Whether a model can be served is the engines' own answer (their model registries, read from their runtimes), and a
stage that cannot take the model's architecture refuses it before anything launches, naming architecture and stage."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from conftest import TINY, cli
from conversions import hf, manifest as mf

ENGINES = ("vllm", "sglang")


def _manifest(ckpt: Path) -> Path:
    mf.write(ckpt, mf.build(ckpt, format="hf-safetensors", stage="external", parameter_count=hf.parameter_count(ckpt),
                            dtype="float32"))
    return ckpt


@pytest.fixture(scope="module")
def engine_registries():
    """Each engine's registry, read once per runtime build (kept in the runtime folder: later sessions pay nothing)."""
    from tasks.runtimes import RuntimeMissing
    from tasks.serve.architectures import served_architectures

    try:
        return {e: served_architectures(e) for e in ENGINES}
    except RuntimeMissing as e:
        pytest.skip(f"{e}")


@pytest.fixture
def gemma3_checkpoint(tmp_path, data_dir) -> Path:
    """A random-init Gemma 3 text model (not in baton's old hand-kept list) with the data stage's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tok = AutoTokenizer.from_pretrained(str(data_dir / "tokenizer"))
    config = Gemma3TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                              sliding_window=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                              pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    dest = tmp_path / "gemma3"
    Gemma3ForCausalLM(config).save_pretrained(str(dest), safe_serialization=True)
    tok.save_pretrained(str(dest))
    return _manifest(dest)


@pytest.fixture
def foo_checkpoint(tmp_path, hf_checkpoint) -> Path:
    """A checkpoint declaring an architecture no engine (nor transformers) has."""
    dest = tmp_path / "foo"
    shutil.copytree(hf_checkpoint, dest)
    (dest / mf.MANIFEST_NAME).unlink()
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(dict(config, architectures=["FooForCausalLM"])))
    return _manifest(dest)


@pytest.mark.fast
def test_the_registries_are_the_engines_own_and_kept_per_runtime(engine_registries):
    from tasks.runtimes import python_for
    from tasks.serve.architectures import CACHE_FILE, served_architectures

    for engine, archs in engine_registries.items():
        assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"} <= archs, engine
        assert "FooForCausalLM" not in archs
        kept = Path(python_for(engine)).parent.parent / CACHE_FILE
        assert json.loads(kept.read_text())["architectures"] == sorted(archs)
        t0 = time.time()
        assert served_architectures(engine) == archs
        assert time.time() - t0 < 1, "read again instead of kept"


@pytest.mark.fast
def test_a_gemma3_model_both_engines_list_passes_the_checks_before_launch(engine_registries, gemma3_checkpoint,
                                                                           tiny_config):
    from flows.config import load
    from flows.pipeline import prepare

    cfg = load(TINY, stages=["finetune", "serve"])
    _, fmt, steps = prepare(cfg, str(gemma3_checkpoint))
    names = [s.name for s in steps]
    assert fmt == "hf-safetensors" and "finetune" in names and names[-1] == "serve"


@pytest.mark.fast
def test_a_model_to_convert_to_megatron_is_refused_unless_llama_style(gemma3_checkpoint):
    from flows.config import ConfigError, load
    from flows.pipeline import prepare

    with pytest.raises(ConfigError) as e:
        prepare(load(TINY, stages=["pretrain"]), str(gemma3_checkpoint))
    assert "architecture ['Gemma3ForCausalLM'] does not convert to Megatron" in str(e.value)
    assert "stage 'convert-hf" in str(e.value)


@pytest.mark.fast
def test_an_architecture_no_engine_lists_is_refused_before_any_stage(engine_registries, foo_checkpoint, baton_home):
    t0 = time.time()
    r = cli("run", str(TINY), "--stages", "serve", "--from", str(foo_checkpoint), home=baton_home)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    line = next(x for x in r.stderr.splitlines() if "FooForCausalLM" in x)
    assert "stage 'serve' (serve.engine both): architectures ['FooForCausalLM']: not in the model registry of " \
           "vllm or sglang" in line
    assert not (baton_home / "runs").exists() and time.time() - t0 < 30


@pytest.mark.fast
def test_the_serve_stage_itself_refuses_it_before_any_server(engine_registries, foo_checkpoint, tmp_path, baton_home,
                                                            tiny_config):
    """`baton serve` (no pipeline before it) gets the same answer, in its preflight."""
    from tasks.serve.config import ServeConfig
    from tasks.serve.task import serve
    from tasks.stage import StageContext

    ctx = StageContext(stage="serve", run_id="test", run_dir=tmp_path, work_dir=tmp_path / "serve",
                       model=tiny_config.model.model_dump(), seed=0, input=foo_checkpoint,
                       input_format="hf-safetensors", tracking={"registered_model": "foo"})
    out = serve(ctx, ServeConfig(engine="sglang"))
    failed = {c["name"]: c["detail"] for c in out.gate["checks"] if not c["passed"]}
    assert "not in the model registry of sglang" in failed["preflight.served_architectures"]
    assert "transformers has no such model class" in failed["preflight.architectures"]
    assert out.extra["servers_started"] == 0
