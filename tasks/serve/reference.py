"""What the served model must reproduce: HF transformers greedy token ids on the same checkpoint and prompts (fp32)."""
from __future__ import annotations

from pathlib import Path

PARITY_INSTRUCTIONS = ["Classify the word: apple", "What kind of thing is tiger?", "Category of paris?",
                       "Is purple a fruit, an animal, a color or a city?", "Name a fruit.", "Give me one city."]


def chat_prompt_ids(tokenizer, instruction: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": instruction}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]


def greedy_reference(model_dir: Path, n_prompts: int, n_tokens: int, model=None) -> list[dict]:
    """[{"instruction", "prompt_ids", "output_ids"}]: HF generate, greedy, EOS not stopping (servers use ignore_eos),
    with model_dir's tokenizer and its model (or `model`: the same architecture holding other weights, fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for instruction in (PARITY_INSTRUCTIONS * n_prompts)[:n_prompts]:
            ids = chat_prompt_ids(tok, instruction)
            prompt = torch.tensor([ids])
            # the mask says every prompt token is real: without it, generate masks each token equal to pad_token_id,
            # and a ChatML model whose pad is <|im_end|> has it in every prompt
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_tokens,
                                 do_sample=False, eos_token_id=None,
                                 pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
            if len(gen) != n_tokens:
                raise RuntimeError(f"HF generate stopped after {len(gen)} of {n_tokens} tokens despite eos=None")
            out.append({"instruction": instruction, "prompt_ids": ids, "output_ids": gen})
    return out


def top2_margin(model_dir: Path, ids: list[int], model=None) -> float:
    """Gap between the two largest next-token logits: tells a genuine divergence from a floating-point tie."""
    import torch
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        prompt = torch.tensor([ids])
        top = model(prompt, attention_mask=torch.ones_like(prompt)).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def logit_gaps(model, prompt_ids: list[int], continuation: list[int], excluded: list[int] = ()) -> list[dict]:
    """Teacher-forced, one forward pass over prompt + continuation: for each continuation token, HF's largest
    next-token logit there (the `excluded` tokens aside: those the engine may not pick) minus that token's own logit,
    and HF's own pick. [{"gap", "hf_top"}] per continuation token."""
    import torch

    ids = torch.tensor([list(prompt_ids) + list(continuation)])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt_ids) - 1:-1].float()
    if excluded:
        logits[:, list(excluded)] = float("-inf")
    top = logits.max(-1)
    own = logits.gather(-1, torch.tensor(continuation)[:, None])[:, 0]
    return [{"gap": float(g), "hf_top": int(t)} for g, t in zip(top.values - own, top.indices)]
