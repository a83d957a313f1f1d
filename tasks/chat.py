"""Conversations through a checkpoint's own chat template, with the spans a trainer learns.

The data stage writes canonical rows (tasks/data/formats.py); the training workers render them here:
    encode(tok, messages, max_len, overlong) -> Encoded    token ids and labels (-100 where not learned): every
                                                          assistant reply (through the template's closing eos) learned
    completion(tok, prompt, reply) -> (prompt_text, reply_text)   preference pairs as TRL's standard strings
    reply_context_ids(tok, messages) -> ids                 what the model saw before its reply (serving must match)
    boundary_problem(tok, conversations) -> str | None     why the template's replies cannot be trained as served
    end_of_turn_id(tok) -> id | None                       the special token the template closes a reply with
    add_end_of_turn_stop(root, tokenizer_dir) -> ids | None   that token made a stop token of the checkpoint at root
A conversation is rendered once and tokenized once, as a server tokenizes the whole rendered history: BPE merges that
cross a turn boundary (plain-text templates have no special token there to cut them) come out as served. The loss is
masked by the replies' character spans. Where a reply starts, the engine's prompt for that turn (the messages before
it, with the generation prompt) must be, token for token, the start of the whole conversation's tokens: a template
whose generation prompt ends inside a token of the reply (`[BOT] ` before `fruit`, which the conversation tokenizes as
` fruit`) would train the reply on a context no server sends, so it is refused (TemplateError), not trained.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from conversions import durable
from conversions.refusal import Refused

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


@dataclass
class Turn:
    """One assistant reply: the rendering of the messages before it with the generation prompt (what an engine's
    prompt for it is), and where the reply starts and ends in the whole conversation's rendering."""
    prompt: str
    start: int
    end: int


def render_turns(tok, messages: list[dict]) -> tuple[str, list[Turn]]:
    """The whole conversation rendered once, and where each assistant reply lies in it."""
    full = _render(tok, messages)
    turns: list[Turn] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], generation_prompt=True)
        upto = _render(tok, messages[:i + 1])
        if not (upto.startswith(before) and full.startswith(upto) and len(before) >= (turns[-1].end if turns else 0)):
            raise TemplateError("the chat template renders a conversation's prefix differently from the whole "
                                "conversation; its assistant turns cannot be located for loss masking")
        turns.append(Turn(before, len(before), len(before) + _reply_end(upto[len(before):], tok.eos_token)))
    return full, turns


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _prompt_length(tok, prompt: str, ids: list[int]) -> int:
    """How many of `ids` (the tokens of a text that starts with `prompt`) are the prompt's own tokens, as an engine
    tokenizes the prompt alone; TemplateError when `ids` do not start with them (a token straddles the boundary)."""
    want = _ids(tok, prompt)
    if ids[:len(want)] == want:
        return len(want)
    k = next((i for i, (a, b) in enumerate(zip(want, ids)) if a != b), min(len(want), len(ids)))
    raise TemplateError(
        f"the chat template's generation prompt does not end on a token boundary: an engine's prompt ends "
        f"{tok.decode(want[k:])!r}, while the conversation it starts tokenizes {tok.decode(ids[k:k + 1])!r} there "
        f"(the prompt's end merged with the reply's start), so the reply would be trained on a context no server "
        f"sends; end the generation prompt where a reply's first token starts (e.g. '[BOT]' and replies rendered as "
        f"' ' + content, not '[BOT] ' and content)")


def _encode_turns(tok, messages: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """(ids, labels, each reply's first token index) of the whole rendering tokenized once. Every token that starts
    inside a reply's span is learned; the reply's first token is the first after its engine prompt's tokens."""
    full, turns = render_turns(tok, messages)
    if not tok.is_fast:  # only a fast (Rust) tokenizer says where each token lies in the text
        raise TemplateError(f"{type(tok).__name__} is a slow tokenizer: training masks replies by the character "
                            "offsets of a fast one (tokenizer.json)")
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels, starts = [IGNORE] * len(ids), []
    for turn in turns:
        first = _prompt_length(tok, turn.prompt, ids)
        starts.append(first)
        for i in range(first, len(ids)):
            if i > first and offsets[i][0] >= turn.end:
                break
            labels[i] = ids[i]
    return ids, labels, starts


@dataclass
class Encoded:
    ids: list[int]
    labels: list[int]
    truncated: bool = False


def encode(tok, messages: list[dict], max_len: int, overlong: str = "drop") -> Encoded | None:
    """Ids and labels of one conversation; None when it is longer than max_len and overlong is 'drop', or when
    truncation leaves nothing to learn."""
    ids, labels, _ = _encode_turns(tok, messages)
    if len(ids) <= max_len:
        return Encoded(ids, labels)
    if overlong != "truncate" or all(x == IGNORE for x in labels[:max_len]):
        return None
    return Encoded(ids[:max_len], labels[:max_len], truncated=True)


def reply_context_ids(tok, messages: list[dict]) -> list[int]:
    """The ids training puts before the model's reply to `messages` (through the generation prompt), from encode()'s
    own tokenization of the conversation with a reply: what a server's own rendering of the same messages must equal."""
    ids, _, starts = _encode_turns(tok, messages + [{"role": "assistant", "content": "reply"}])
    return ids[:starts[-1]]


# Replies that start with a letter, a digit and punctuation, after a first turn and after a second.
BOUNDARY_PROBES = [[{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "And a city?"}, {"role": "assistant", "content": reply}]
                   for reply in ("fruit: mango", "42", "\"Paris\"")]


def boundary_problem(tok, conversations: list[list[dict]] = ()) -> str | None:
    """Why conversations rendered with the tokenizer's template cannot be trained as engines serve them, or None:
    probed with replies of each kind of first character and with the given conversations (e.g. a dataset's first
    rows: whether a merge crosses the generation prompt's end depends on the vocabulary and on the reply)."""
    for messages in [*BOUNDARY_PROBES, *conversations]:
        try:
            _encode_turns(tok, messages)
        except TemplateError as e:
            reply = next(m["content"] for m in messages if m["role"] == "assistant")
            return f"{e} (a reply starting {reply[:24]!r})"
    return None


def prompt_text(tok, prompt: list[dict]) -> str:
    return _render(tok, prompt, generation_prompt=True)


def completion(tok, prompt: list[dict], reply: list[dict]) -> tuple[str, str]:
    """A preference side as strings: the prompt with the generation prompt, the reply through its closing eos."""
    before = prompt_text(tok, prompt)
    full = _render(tok, prompt + reply)
    if not full.startswith(before):
        raise TemplateError("the chat template renders the prompt differently with and without the reply")
    seg = full[len(before):]
    seg = seg[:_reply_end(seg, tok.eos_token)]
    _prompt_length(tok, before, _ids(tok, before + seg))  # TRL tokenizes prompt + reply as one text
    return before, seg


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
