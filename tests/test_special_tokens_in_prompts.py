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
