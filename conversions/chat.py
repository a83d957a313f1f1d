"""Conversations through a checkpoint's own chat template, with the spans a trainer learns.

The data stage writes canonical rows (tasks/data/formats.py); the training workers render them here:
    render_segments(tok, messages) -> [(text, learned)]   every assistant reply (up to and including the template's
                                                          closing eos) learned, everything else context
    encode(tok, messages, max_len, overlong) -> Encoded    token ids and labels (-100 where not learned)
    completion(tok, prompt, reply) -> (prompt_text, reply_text)   preference pairs as TRL's standard strings
    reply_context_ids(tok, messages) -> ids                 what the model saw before its reply (serving must match)
Segments are tokenized one by one, as a server tokenizes a rendered prompt and then generates the reply.
"""
from __future__ import annotations

from dataclasses import dataclass

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
