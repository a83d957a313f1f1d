"""Packing (finetune.packing): examples share max_seq_length windows without attending to each other, so the loss of
a packed batch is the loss of the same examples unpacked (a real Llama, the worker's own collation)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.fast

IGNORE = -100


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Conversations as the worker encodes them: a prompt (not learned) then an answer (learned), varied lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt, answer = (int(x) for x in torch.randint(3, 12, (2,), generator=g))
        ids = torch.randint(1, 64, (prompt + answer,), generator=g).tolist()
        out.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_packed_loss_and_gradients_equal_unpacked(attention):
    from tasks.finetune import worker

    model = _model()
    model.config._attn_implementation = attention
    examples = _examples(9)
    windows = worker.pack(examples, max_len=48)
    assert 1 < len(windows) < len(examples) and sum(map(len, windows)) == len(examples)
    assert all(sum(len(x) for x, _ in w) <= 48 for w in windows)

    unpacked, n_unpacked = worker.collate(examples, pad_id=0)
    packed, n_packed = worker.collate_packed(windows, pad_id=0, max_len=48)
    assert n_packed == n_unpacked == sum(len(x) for x, _ in examples)
    assert int((packed["labels"] != IGNORE).sum()) == int((unpacked["labels"][:, 1:] != IGNORE).sum())

    losses, grads = [], []
    for batch in (unpacked, packed):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert abs(losses[0] - losses[1]) < 1e-5, losses
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4), (grads[0] - grads[1]).abs().max()


def test_packing_without_restarting_positions_would_differ():
    """The check above can fail: the same windows with positions running on across examples (attention then spans
    examples) give another loss."""
    from tasks.finetune import worker

    model = _model()
    windows = worker.pack(_examples(9), max_len=48)
    packed, _ = worker.collate_packed(windows, pad_id=0, max_len=48)
    running = dict(packed, position_ids=torch.arange(48).expand(len(windows), 48))
    unpacked, _ = worker.collate(_examples(9), pad_id=0)
    with torch.no_grad():
        assert abs(model(**running).loss.item() - model(**unpacked).loss.item()) > 1e-3
