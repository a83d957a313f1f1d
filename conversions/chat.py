"""Conversations through a checkpoint's own chat template, with the spans a trainer learns.

The data stage writes canonical rows (tasks/data/formats.py); the training workers render them here:
    render_segments(tok, messages) -> [(text, learned)]   every assistant reply (up to and including the template's
                                                          closing eos) learned, everything else context
    encode(tok, messages, max_len, overlong) -> Encoded    token ids and labels (-100 where not learned)
    completion(tok, prompt, reply) -> (prompt_text, reply_text)   preference pairs as TRL's standard strings
    reply_context_ids(tok, messages) -> ids                 what the model saw before its reply (serving must match)
    end_of_turn_id(tok) -> id | None                       the special token the template closes a reply with
    add_end_of_turn_stop(root, tokenizer_dir) -> ids | None   that token made a stop token of the checkpoint at root
Segments are tokenized one by one, as a server tokenizes a rendered prompt and then generates the reply.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import durable
from .refusal import Refused

IGNORE = -100


class TemplateError(Refused):
    pass


def _render(tok, messages: list[dict], generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def _reply_end(segment: str, eos: str | None) -> int:
    """Where a rendered reply ends: after its last eos (the template's closing token), else the whole segment."""
    if eos and eos in segment:
        return segment.rindex(eos) + len(eos)
    return len(segment)


def render_segments(tok, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, learned) pieces: each assistant turn is learned."""
    full = _render(tok, messages)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], generation_prompt=True)
        upto = _render(tok, messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
            raise TemplateError("the chat template renders a conversation's prefix differently from the whole "
                                "conversation; its assistant turns cannot be located for loss masking")
        end = len(before) + _reply_end(upto[len(before):], tok.eos_token)
        segments += [(full[pos:len(before)], False), (full[len(before):end], True)]
        pos = end
    segments.append((full[pos:], False))
    return [(t, learned) for t, learned in segments if t]


@dataclass
class Encoded:
    ids: list[int]
    labels: list[int]
    truncated: bool = False


def encode(tok, messages: list[dict], max_len: int, overlong: str = "drop") -> Encoded | None:
    """Ids and labels of one conversation; None when it is longer than max_len and overlong is 'drop', or when
    truncation leaves nothing to learn."""
    ids: list[int] = []
    labels: list[int] = []
    for text, learned in render_segments(tok, messages):
        part = tok(text, add_special_tokens=False)["input_ids"]
        ids += part
        labels += part if learned else [IGNORE] * len(part)
    if len(ids) <= max_len:
        return Encoded(ids, labels)
    if overlong != "truncate" or all(x == IGNORE for x in labels[:max_len]):
        return None
    return Encoded(ids[:max_len], labels[:max_len], truncated=True)


def reply_context_ids(tok, messages: list[dict]) -> list[int]:
    """The ids training puts before the model's reply to `messages` (through the generation prompt), tokenized segment
    by segment as encode() does: what a server's own rendering of the same conversation must equal."""
    segments = render_segments(tok, messages + [{"role": "assistant", "content": "reply"}])
    reply = max(i for i, (_, learned) in enumerate(segments) if learned)
    return [t for text, _ in segments[:reply] for t in tok(text, add_special_tokens=False)["input_ids"]]


def prompt_text(tok, prompt: list[dict]) -> str:
    return _render(tok, prompt, generation_prompt=True)


def completion(tok, prompt: list[dict], reply: list[dict]) -> tuple[str, str]:
    """A preference side as strings: the prompt with the generation prompt, the reply through its closing eos."""
    before = prompt_text(tok, prompt)
    full = _render(tok, prompt + reply)
    if not full.startswith(before):
        raise TemplateError("the chat template renders the prompt differently with and without the reply")
    seg = full[len(before):]
    return before, seg[:_reply_end(seg, tok.eos_token)]


def adds_bos(tok) -> bool:
    """Whether tokenizing text with the tokenizer's special tokens puts its BOS in front (Llama, Gemma tokenizers)."""
    bos = tok.bos_token_id
    return bos is not None and tok("a")["input_ids"][:1] == [bos] and tok("a", add_special_tokens=False)["input_ids"][:1] != [bos]


def for_special_tokens(tok, rendered: str) -> str:
    """A rendered prompt for a consumer that tokenizes it with the tokenizer's special tokens (TRL's string datasets):
    without the template's own leading BOS when the tokenizer adds one, so the model sees one BOS, as in serving."""
    if tok.bos_token and rendered.startswith(tok.bos_token) and adds_bos(tok):
        return rendered[len(tok.bos_token):]
    return rendered


# A conversation with a known assistant reply: what the template writes right after the reply closes the turn.
TURN_PROBE = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "fruit: mango"}]


def special_ids(tok) -> set[int]:
    return set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}


def end_of_turn_id(tok) -> int | None:
    """The special token the chat template writes right after an assistant reply (<end_of_turn>, <|im_end|>, the eos),
    found by rendering a conversation with a known reply through the tokenizer's own renderer; None when plain text,
    or nothing, follows the reply."""
    rendered = _render(tok, TURN_PROBE)
    reply = TURN_PROBE[-1]["content"]
    if reply not in rendered:
        return None
    after = rendered[rendered.rindex(reply) + len(reply):]
    ids = tok(after, add_special_tokens=False)["input_ids"]
    return ids[0] if ids and ids[0] in special_ids(tok) else None


def _json(path: Path) -> dict:
    obj = json.loads(path.read_text()) if path.exists() else {}
    return obj if isinstance(obj, dict) else {}


def add_end_of_turn_stop(root: Path, tokenizer_dir: Path | None = None) -> list[int] | None:
    """Make the chat template's end-of-turn token a stop token of the HF checkpoint at root when it is not one yet:
    generation_config.json's eos_token_id becomes the list of the stop ids it had (else config.json's) and the
    end-of-turn id. vLLM, SGLang and HF generate stop at every id listed there. Returns the new stop ids, or None when
    nothing changed (the template's reply ends in a stop token already, or in no special token)."""
    from transformers import AutoTokenizer

    root = Path(root)
    end = end_of_turn_id(AutoTokenizer.from_pretrained(str(tokenizer_dir or root)))
    config, generation = _json(root / "config.json"), _json(root / "generation_config.json")
    stops = generation.get("eos_token_id", config.get("eos_token_id"))
    stops = list(stops) if isinstance(stops, list) else ([stops] if stops is not None else [])
    if end is None or end in stops:
        return None
    if not generation:  # what HF derives from config.json when the file is missing, plus the new stop
        generation = {k: config[k] for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    durable.write_json(root / "generation_config.json", {**generation, "eos_token_id": stops + [end]})
    return stops + [end]
