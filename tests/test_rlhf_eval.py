"""The rlhf worker's held-out evaluation against its definition (one unpadded sequence per forward), on the tiny
config's held-out preference pairs and two random-init checkpoints: one sequence per forward gives exactly the same
numbers; batched forwards (padded, other matrix shapes) round differently in the last bits, so loss and KL agree to
1e-6 relative (measured: 1e-7) and the accuracy is the same."""
from __future__ import annotations

import pytest
import torch

from conftest import make_hf_checkpoint
from tasks.rlhf import worker

pytestmark = pytest.mark.fast


def split_by_offsets(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """prompt+completion tokenized once; the completion is the tokens that start at or after the prompt's last
    character (the tokenizer's own offsets, not the worker's divergence rule)."""
    enc = tok(prompt + completion, add_special_tokens=False, return_offsets_mapping=True)
    first = next(i for i, (start, _) in enumerate(enc["offset_mapping"]) if start >= len(prompt))
    return enc["input_ids"][:first], enc["input_ids"][first:]


def one_at_a_time(model, tok, pairs, ref):
    """The definition, one unpadded sequence per forward: accuracy, mean chosen loss per token, mean KL per token."""
    def logps(m, prompt, completion):
        p, c = split_by_offsets(tok, prompt, completion)
        with torch.no_grad():
            out = torch.log_softmax(m(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float(), dim=-1)
        return out, torch.tensor(c)

    wins, loss, tokens, kl = 0, 0.0, 0, 0.0
    for pair in pairs:
        lp, c = logps(model, pair["prompt"], pair["chosen"])
        lr, r = logps(model, pair["prompt"], pair["rejected"])
        chosen = lp.gather(-1, c[:, None]).sum().item()
        wins += chosen > lr.gather(-1, r[:, None]).sum().item()
        loss -= chosen
        tokens += len(c)
        kl += (lp.exp() * (lp - logps(ref, pair["prompt"], pair["chosen"])[0])).sum().item()
    return {"accuracy": wins / len(pairs), "loss": loss / tokens, "kl": kl / tokens}


def test_batched_heldout_facts_equal_one_sequence_at_a_time(tmp_path, tiny_config, data_dir, hf_checkpoint):
    from transformers import AutoTokenizer

    other = make_hf_checkpoint(tmp_path / "other", tiny_config.model.model_dump(), data_dir / "tokenizer", seed=1)
    tok = AutoTokenizer.from_pretrained(str(hf_checkpoint))
    pairs = worker.format_pairs(tok, worker.read_jsonl(data_dir / "preference" / "heldout.jsonl"))
    # a random-init model prefers the shorter (rejected) reply of every synthetic pair: swap every third pair
    pairs = [dict(p, chosen=p["rejected"], rejected=p["chosen"]) if i % 3 == 0 else p for i, p in enumerate(pairs)]
    policy, ref = worker.load_eval_model(other, "dpo"), worker.load_eval_model(hf_checkpoint, "dpo")
    expected = one_at_a_time(policy.eval(), tok, pairs, ref.eval())
    assert 0.0 < expected["accuracy"] < 1.0 and expected["kl"] > 0.0, expected  # a comparison that can tell
    assert worker.policy_facts(policy, tok, pairs, ref=ref, batch=1) == expected
    for batch in (7, worker.EVAL_BATCH, len(pairs) * 2):
        got = worker.policy_facts(policy, tok, pairs, ref=ref, batch=batch)
        assert got["accuracy"] == expected["accuracy"], batch
        assert got == pytest.approx(expected, rel=1e-6, abs=0), batch
    assert worker.policy_facts(policy, tok, pairs).keys() == {"accuracy", "loss"}
