"""Special tokens as real models ship them, which baton's own tiny models never had: a ChatML model whose pad token is
its eos and end-of-turn `<|im_end|>` (SmolLM2, several Qwen-style models), so every chat prompt contains the pad id.
Every greedy decode baton runs must read the prompt as it is: the same tokens as a plain forward loop that masks
nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.serve import reference

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chatml_model(dest: Path) -> Path:
    """A random-init Llama with a ChatML tokenizer whose pad = eos = <|im_end|>, saved as any HF user would."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(reference.PARITY_INSTRUCTIONS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(dest))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(str(dest), safe_serialization=True)
    return dest


def argmax_loop(model_dir: Path, ids: list[int], n_tokens: int) -> list[int]:
    """Greedy decoding as its definition: the whole sequence forward, argmax of the last position, appended."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n_tokens):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory) -> Path:
    return chatml_model(tmp_path_factory.mktemp("chatml"))


@pytest.mark.fast
def test_the_served_models_reference_reads_a_prompt_that_contains_the_pad_token(chatml_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chatml_dir))
    prompt = reference.chat_prompt_ids(tok, "Name a fruit.")
    assert tok.pad_token_id == tok.eos_token_id and prompt.count(tok.pad_token_id) == 1  # what makes it a trap
    refs = reference.greedy_reference(chatml_dir, n_prompts=6, n_tokens=6)
    got = {r["instruction"]: r["output_ids"] for r in refs}
    want = {r["instruction"]: argmax_loop(chatml_dir, r["prompt_ids"], 6) for r in refs}
    assert got == want


# Gemma-style: the template writes the BOS itself and the tokenizer adds one too
GEMMA_STYLE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
               "{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def bos_adding_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(reference.PARITY_INSTRUCTIONS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bpe.token_to_id("<bos>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<end_of_turn>", pad_token="<pad>")
    tok.chat_template = GEMMA_STYLE
    return tok


@pytest.mark.fast
def test_trl_gets_the_preference_prompts_with_one_bos_as_evaluation_and_serving_do():
    from tasks.rlhf.worker import format_pairs, trl_pairs

    tok = bos_adding_tokenizer()
    row = {"prompt": [{"role": "user", "content": "Name a fruit."}],
           "chosen": [{"role": "assistant", "content": "apple"}], "rejected": [{"role": "assistant", "content": "paris"}]}
    pair = format_pairs(tok, [row])[0]
    # held-out evaluation's tokenization, and the served conversation's start
    evaluated = tok(pair["prompt"] + pair["chosen"], add_special_tokens=False)["input_ids"]
    served = tok.apply_chat_template(row["prompt"] + row["chosen"], return_dict=True)["input_ids"]
    assert evaluated == served[:len(evaluated)] and evaluated.count(tok.bos_token_id) == 1
    assert tok(text=pair["prompt"] + pair["chosen"])["input_ids"][:2] == [tok.bos_token_id] * 2  # the trap
    trl = trl_pairs(tok, [pair])[0]
    # TRL's own tokenization of a string dataset: the tokenizer called with its special tokens
    assert tok(text=trl["prompt"] + trl["chosen"])["input_ids"] == evaluated
    assert trl_pairs(tok, [pair]) == [trl] and trl["chosen"] == pair["chosen"]


# ---- the serving contract in the manifest ----------------------------------------------------------------------------
def _child(parent: Path, dest: Path) -> Path:
    """A copy of parent with a manifest naming parent as its parent (as every stage's output has)."""
    import shutil

    from conversions import manifest as mf

    shutil.copytree(parent, dest)
    (dest / mf.MANIFEST_NAME).unlink(missing_ok=True)
    return dest


def _seal(folder: Path, parent: Path | None = None) -> dict:
    from conversions import hf, manifest as mf

    m = mf.build(folder, format="hf-safetensors", stage="test", parameter_count=hf.parameter_count(folder),
                 dtype="float32", parent=mf.parent_ref(parent) if parent else None)
    mf.write(folder, m)
    return m


@pytest.mark.fast
def test_the_manifest_records_the_serving_contract(chatml_dir, tmp_path):
    import hashlib
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(chatml_dir, model)
    serving = _seal(model)["serving"]
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    template = (model / "chat_template.jinja").read_text() if (model / "chat_template.jinja").exists() else \
        tok_cfg["chat_template"]
    assert serving["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert serving["special_tokens"] == {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}
    config = json.loads((model / "config.json").read_text())
    assert serving["token_ids"] == {"bos_token": None, "eos_token": config["eos_token_id"],
                                    "pad_token": config["pad_token_id"]}
    assert serving["stop_token_ids"] == [config["eos_token_id"]]
    assert len(serving["tokenizer_sha256"]) == 64 and serving["generation_config"]["eos_token_id"] == config["eos_token_id"]


@pytest.mark.fast
def test_a_stage_output_that_changes_template_or_stop_tokens_says_so(chatml_dir, tmp_path):
    import json
    import shutil

    from flows.step_gate import serving_changes

    parent = tmp_path / "parent"
    shutil.copytree(chatml_dir, parent)
    _seal(parent)
    same = _child(parent, tmp_path / "same")
    _seal(same, parent)
    assert serving_changes(same) == []

    drift = _child(parent, tmp_path / "drift")
    if (drift / "chat_template.jinja").exists():
        (drift / "chat_template.jinja").write_text(CHATML.replace("<|im_start|>assistant", "<|im_start|>bot"))
    else:
        cfg = json.loads((drift / "tokenizer_config.json").read_text())
        (drift / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=CHATML.replace("assistant", "bot"))))
    gen = json.loads((drift / "generation_config.json").read_text())
    (drift / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[gen["eos_token_id"], 0])))
    _seal(drift, parent)
    changed = serving_changes(drift)
    assert [c.split(":")[0] for c in changed] == ["chat_template_sha256", "generation_config.eos_token_id",
                                                  "stop_token_ids"], changed
    assert f"stop_token_ids: [{gen['eos_token_id']}] → [0, {gen['eos_token_id']}]" in changed


@pytest.mark.fast
def test_a_serving_contract_change_nobody_asked_for_fails_the_gate_naming_the_field(chatml_dir, tmp_path):
    import json
    import shutil

    from conftest import TINY
    from flows.config import load
    from flows.step_gate import serving_contract_check

    parent = tmp_path / "parent"
    shutil.copytree(chatml_dir, parent)
    _seal(parent)
    assert serving_contract_check(parent, load(TINY)) is None  # no parent: nothing to compare
    same = _child(parent, tmp_path / "same")
    _seal(same, parent)
    assert serving_contract_check(same, load(TINY))["passed"]

    template_drift = _child(parent, tmp_path / "template")
    (template_drift / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((template_drift / "tokenizer_config.json").read_text())
    (template_drift / "tokenizer_config.json").write_text(
        json.dumps(dict(tok_cfg, chat_template=CHATML.replace("assistant", "bot"))))
    _seal(template_drift, parent)
    failed = serving_contract_check(template_drift, load(TINY))
    assert not failed["passed"] and failed["name"] == "contract.serving"
    assert failed["detail"].startswith("changed without the config asking: chat_template_sha256: "), failed
    (tmp_path / "chatml.jinja").write_text(CHATML)
    asking = [f"model.chat_template={tmp_path / 'chatml.jinja'}"]
    asked = serving_contract_check(template_drift, load(TINY, asking))
    assert asked["passed"] and "(model.chat_template)" in asked["detail"], asked

    eos_drift = _child(parent, tmp_path / "eos")
    tok_cfg = json.loads((eos_drift / "tokenizer_config.json").read_text())
    (eos_drift / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, eos_token="<|im_start|>")))
    _seal(eos_drift, parent)
    for cfg in (load(TINY), load(TINY, asking)):  # a template asks for no new eos
        failed = serving_contract_check(eos_drift, cfg)
        assert not failed["passed"], failed
        assert "special_tokens.eos_token: '<|im_end|>' → '<|im_start|>'" in failed["detail"], failed


# ---- the serving contract on a live server: what its checks compare with --------------------------------------------
@pytest.mark.fast
def test_the_training_rendering_a_server_must_match_is_the_trainers_context_with_one_bos(chatml_dir):
    from transformers import AutoTokenizer

    from tasks.chat import encode, reply_context_ids
    from tasks.serve.smoke import CONVERSATIONS

    for tok in (AutoTokenizer.from_pretrained(str(chatml_dir)), bos_adding_tokenizer()):
        for messages in CONVERSATIONS.values():
            ids = reply_context_ids(tok, messages)
            trained = encode(tok, messages + [{"role": "assistant", "content": "fruit: kiwi"}], max_len=512)
            assert trained.ids[:len(ids)] == ids and trained.labels[len(ids) - 1] == -100
            assert trained.labels[len(ids)] != -100  # the reply starts right after: ids are its whole context
            assert ids == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            assert ids.count(tok.bos_token_id) == (tok.bos_token_id is not None)


@pytest.mark.fast
@pytest.mark.parametrize("engine, logged_in, fields_in", [
    ("vllm", "vllm/config/model.py", "vllm/config/model.py"),
    ("sglang", "sglang/srt/entrypoints/openai/serving_chat.py", "sglang/srt/configs/model_config.py")])
def test_the_sampling_defaults_line_read_from_the_server_log_is_the_engines_own(engine, logged_in, fields_in):
    """smoke.generation_defaults reads what each engine logs when it takes generation_config.json's sampling defaults:
    the message is the one in the built runtime's source (read, not imported), so an engine upgrade that rewords it
    fails here rather than passing the check with nothing found."""
    from tasks.runtimes import runtime_dir
    from tasks.serve import smoke

    def source(rel: str) -> str:
        found = sorted(runtime_dir(engine).glob(f"lib/python*/site-packages/{rel}"))
        if not found:
            pytest.skip(f"the {engine} runtime is not built (make runtimes)")
        return found[0].read_text()

    prefix = smoke.DEFAULTS_REPORTED[engine].pattern.split("(")[0].split(".*?")[0].replace("\\", "")
    assert prefix.strip() and prefix in source(logged_in), prefix
    fields = source(fields_in)
    for field in smoke.DEFAULT_FIELDS[engine]:
        assert f'"{field}"' in fields, field


GEMMA_TURNS = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else "
               "'user') + '\n' + m['content'] + '<end_of_turn>\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


@pytest.mark.fast
def test_template_markers_are_special_tokens_not_the_newlines_gemma_adds_as_tokens():
    """Gemma's vocabulary adds '\\n', '\\n\\n', ... as tokens of their own (not special); its turn format writes '\\n'
    after each turn marker. A reply that ends with a newline leaks no template text: the markers are the special
    tokens the template writes, <start_of_turn> and <end_of_turn>."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from tasks.serve import smoke

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "fruit", "apple"])}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                  bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("\n", "\n\n")])
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TURNS
    assert "\n" in {t.content for t in tok.added_tokens_decoder.values()}  # the case: a plain added token
    assert smoke.template_markers(tok) == ["<end_of_turn>", "<start_of_turn>"]
