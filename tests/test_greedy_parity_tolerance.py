"""Greedy parity on a quantised GGUF (tasks/serve/smoke.py tolerant_parity): HF, fed the engine's tokens, must find
each within the type's served_logit_gap of its largest logit. Here the "engine" is another real model: the reference
with its weights moved, whose greedy decisions part from the reference's; and the reference's own greedy tokens, with
its end-of-turn token banned as llama-server bans it under ignore_eos. No server: the check's decision alone."""
from __future__ import annotations

import pytest

from conversions.gguf_export import TYPES
from tasks.serve.smoke import tolerant_parity

pytestmark = pytest.mark.fast
TOLERANCE = TYPES["q4_K_M"].served_logit_gap
PROMPT, N_TOKENS = [1, 17, 42, 99, 7, 3], 16


def _model(seed: int, scale: float = 0.0):
    """A random-init Llama with logits of a trained model's spread (a few nats between the top candidates), or
    with every weight moved by `scale` of its own std (seed: the noise's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                         bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
    if scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return model


def _greedy(model, banned: list[int] = ()) -> list[int]:
    import torch

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=2, bad_words_ids=[[t] for t in banned] or None)
    return out[0, len(PROMPT):].tolist()


def _reference(model) -> list[dict]:
    return [{"instruction": "probe", "prompt_ids": PROMPT, "output_ids": _greedy(model)}]


def test_an_engine_whose_greedy_decisions_part_from_hfs_is_refused_naming_position_tokens_and_gap():
    reference_model, moved = _model(0), _model(1, scale=0.5)
    ref = _reference(reference_model)
    theirs = _greedy(moved)
    assert theirs != ref[0]["output_ids"]  # a real divergence: another model's own greedy decisions
    c = tolerant_parity("llamacpp", ref, [theirs], reference_model, [2], TOLERANCE)
    assert not c["passed"], c
    k = next(i for i, (a, b) in enumerate(zip(theirs, ref[0]["output_ids"])) if a != b)
    assert f"token {k}, the server's {theirs[k]} " in c["detail"] and f"tolerance {TOLERANCE:g}" in c["detail"], c


def test_the_references_own_greedy_tokens_pass_with_its_stop_token_banned_as_llama_server_bans_it():
    """llama-server's ignore_eos sets the stop tokens' logits to -inf: where HF's greedy pick is one, the engine takes
    the next. The check leaves them out of HF's max for such an engine only."""
    from tasks.serve.reference import top2_margin

    model = _model(0)
    ref = _reference(model)
    out = ref[0]["output_ids"]
    # the stop token: a token HF's greedy decoding picks first at k, where it leads the next by more than the tolerance
    k = max((i for i in range(N_TOKENS) if out[i] not in out[:i]),
            key=lambda i: top2_margin(None, PROMPT + out[:i], model))
    assert top2_margin(None, PROMPT + out[:k], model) > TOLERANCE
    stop = [out[k]]
    banned = _greedy(model, banned=stop)
    assert banned[:k] == out[:k] and banned[k] != out[k]
    own = tolerant_parity("llamacpp", ref, [ref[0]["output_ids"]], model, [], TOLERANCE)
    assert own["passed"] and "the largest gap 0.000" in own["detail"] and "16 of 16" in own["detail"], own
    assert tolerant_parity("llamacpp", ref, [banned], model, stop, TOLERANCE)["passed"]
    unbanned = tolerant_parity("vllm", ref, [banned], model, stop, TOLERANCE)  # vLLM does not ban: HF's max counts
    assert not unbanned["passed"] and f"token {k}," in unbanned["detail"], unbanned
