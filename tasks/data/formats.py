"""The dataset formats the field uses, detected from columns (or declared), validated row by row and normalised into
one canonical chat form that the training workers read:

    pretrain    {"text": str}
    sft         {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}   ends with an assistant
                turn; a tool message (a tool's result, rlhf.tools) answers the assistant message before it
    preference  {"prompt": [messages ending with user], "chosen": [assistant...], "rejected": [assistant...]}
    prompts     {"prompt": [messages ending with user], "answer": str, ...every other column, unchanged}

Source formats (canonical field → source column through an optional `columns:` mapping):
    text                 text                         (.txt/.md files: one document per paragraph)
    alpaca               instruction, output, [input], [system]
    prompt_completion    prompt, completion           (strings, or message lists as in TRL's conversational form)
    messages             messages (role/content)
    sharegpt             conversations (from/value; human/gpt aliases)
    preference           prompt, chosen, rejected     (strings or message lists)
    implicit_preference  chosen, rejected             (whole conversations that share a prompt prefix, as HH-RLHF)
    prompt_answer        prompt, answer               (prompt: a string or messages; answer: a string or a number;
                                                       other columns are kept for the rewards: rlhf.rewards)

Every bad row is a `Problem` (where, field, reason); nothing here raises on a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from conversions.refusal import Refused

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant", "bot": "assistant"}

FORMATS: dict[str, dict[str, tuple[str, ...]]] = {  # kind → format → required canonical fields (detection order)
    "pretrain": {"text": ("text",)},
    "sft": {"messages": ("messages",), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
            "prompt_completion": ("prompt", "completion")},
    "preference": {"preference": ("prompt", "chosen", "rejected"), "implicit_preference": ("chosen", "rejected")},
    "prompts": {"prompt_answer": ("prompt", "answer")},
}
RESERVED = ("completion", "completions")  # a user reward's own arguments: a column may not take their names
OPTIONAL = {"alpaca": ("input", "system")}


@dataclass(frozen=True)
class Problem:
    where: str      # file:line (or hub split:row)
    field: str
    reason: str     # missing | null | wrong_type | empty | unknown_role | role_order | invalid_json | no_shared_prompt
    #                 | reserved
    detail: str = ""

    def message(self) -> str:
        return f"{self.where}: field '{self.field}': {self.reason.replace('_', ' ')}" + (
            f" ({self.detail})" if self.detail else "")


class RowError(Refused):
    def __init__(self, field: str, reason: str, detail: str = ""):
        super().__init__(detail)
        self.field, self.reason, self.detail = field, reason, detail


def detect(kind: str, columns: set[str], mapping: dict[str, str]) -> str | None:
    """The first format of this kind whose required fields (through the mapping) are all columns."""
    for name, required in FORMATS[kind].items():
        if all(mapping.get(f, f) in columns for f in required):
            return name
    return None


def kind_of(fmt: str) -> str:
    return next(k for k, formats in FORMATS.items() if fmt in formats)


# ---- field readers: each raises RowError naming the field -----------------------------------------------------------
def _get(row: dict, field: str, mapping: dict, optional: bool = False):
    col = mapping.get(field, field)
    if col not in row:
        if optional:
            return None
        raise RowError(col, "missing")
    value = row[col]
    if value is None and not optional:
        raise RowError(col, "null")
    return value


def _text(value, field: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RowError(field, "wrong_type", f"expected a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise RowError(field, "empty")
    return value


def _messages(value, field: str, role_key: str = "role", content_key: str = "content") -> list[dict]:
    if not isinstance(value, list):
        raise RowError(field, "wrong_type", f"expected a list of messages, got {type(value).__name__}")
    if not value:
        raise RowError(field, "empty")
    out = []
    for i, m in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RowError(where, "wrong_type", f"expected an object, got {type(m).__name__}")
        for key in (role_key, content_key):
            if m.get(key) is None:
                raise RowError(f"{where}.{key}", "missing" if key not in m else "null")
        role = m[role_key]
        if not isinstance(role, str):
            raise RowError(f"{where}.{role_key}", "wrong_type", f"expected a string, got {type(role).__name__}")
        role = ROLE_ALIASES.get(role.lower(), role.lower())
        if role not in ROLES:
            raise RowError(f"{where}.{role_key}", "unknown_role", f"{m[role_key]!r}; known: {', '.join(ROLES)}")
        out.append({"role": role, "content": _text(m[content_key], f"{where}.{content_key}")})
    return out


def check_order(messages: list[dict], field: str, ends_with: str) -> None:
    """An optional system message first, then user/assistant alternating from user, ending with `ends_with`; a tool
    message (the result of the assistant's tool call) may take a user message's place after the first."""
    body = messages[1:] if messages[0]["role"] == "system" else messages
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected and not (expected == "user" and i > 0 and m["role"] == "tool"):
            pos = i + (len(messages) - len(body))
            raise RowError(f"{field}[{pos}].role", "role_order",
                           f"{m['role']!r} where {expected!r} was expected (system?, user, assistant, user, ...)")
    if not body or body[-1]["role"] != ends_with:
        raise RowError(field, "role_order", f"must end with a {ends_with} message")


def _string_or_messages(value, field: str) -> None:
    if not isinstance(value, (str, list)):
        raise RowError(field, "wrong_type", f"expected a string or a list of messages, got {type(value).__name__}")


def _reply(value, field: str) -> list[dict]:
    """A completion: a string (one assistant message) or assistant (and user) messages ending with assistant."""
    _string_or_messages(value, field)
    if isinstance(value, str):
        return [{"role": "assistant", "content": _text(value, field)}]
    msgs = _messages(value, field)
    if msgs[0]["role"] != "assistant" or msgs[-1]["role"] != "assistant":
        raise RowError(field, "role_order", "a reply must start and end with an assistant message")
    return msgs


def _prompt(value, field: str) -> list[dict]:
    _string_or_messages(value, field)
    if isinstance(value, str):
        return [{"role": "user", "content": _text(value, field)}]
    msgs = _messages(value, field)
    check_order(msgs, field, ends_with="user")
    return msgs


# ---- one function per format: source row → canonical row ------------------------------------------------------------
def _text_row(row, m):
    return {"text": _text(_get(row, "text", m), m.get("text", "text"))}


def _alpaca(row, m):
    instruction = _text(_get(row, "instruction", m), m.get("instruction", "instruction"))
    extra = _get(row, "input", m, optional=True)
    if extra is not None and _text(extra, m.get("input", "input"), allow_empty=True).strip():
        instruction = f"{instruction}\n\n{extra}"
    msgs = [{"role": "user", "content": instruction},
            {"role": "assistant", "content": _text(_get(row, "output", m), m.get("output", "output"))}]
    system = _get(row, "system", m, optional=True)
    if system is not None and _text(system, m.get("system", "system"), allow_empty=True).strip():
        msgs.insert(0, {"role": "system", "content": system})
    return {"messages": msgs}


def _prompt_completion(row, m):
    prompt = _prompt(_get(row, "prompt", m), m.get("prompt", "prompt"))
    completion = _reply(_get(row, "completion", m), m.get("completion", "completion"))
    msgs = prompt + completion
    check_order(msgs, m.get("completion", "completion"), ends_with="assistant")
    return {"messages": msgs}


def _messages_row(row, m):
    field = m.get("messages", "messages")
    msgs = _messages(_get(row, "messages", m), field)
    check_order(msgs, field, ends_with="assistant")
    return {"messages": msgs}


def _sharegpt(row, m):
    field = m.get("conversations", "conversations")
    msgs = _messages(_get(row, "conversations", m), field, role_key="from", content_key="value")
    check_order(msgs, field, ends_with="assistant")
    return {"messages": msgs}


def _preference(row, m):
    prompt = _prompt(_get(row, "prompt", m), m.get("prompt", "prompt"))
    return {"prompt": prompt, "chosen": _reply(_get(row, "chosen", m), m.get("chosen", "chosen")),
            "rejected": _reply(_get(row, "rejected", m), m.get("rejected", "rejected"))}


def _implicit_preference(row, m):
    fc, fr = m.get("chosen", "chosen"), m.get("rejected", "rejected")
    chosen, rejected = _messages(_get(row, "chosen", m), fc), _messages(_get(row, "rejected", m), fr)
    check_order(chosen, fc, ends_with="assistant")
    check_order(rejected, fr, ends_with="assistant")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n > 0 and chosen[n - 1]["role"] != "user":  # the prompt ends with the user turn both replies answer
        n -= 1
    if n == 0:
        raise RowError(fc, "no_shared_prompt", "chosen and rejected share no conversation prefix ending with a user turn")
    return {"prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def _prompt_answer(row, m):
    fp, fa = m.get("prompt", "prompt"), m.get("answer", "answer")
    answer = _get(row, "answer", m)
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise RowError(fa, "wrong_type", f"expected a string or a number, got {type(answer).__name__}")
    extra = {k: v for k, v in row.items() if k not in (fp, fa)}
    for name in RESERVED:
        if name in extra:
            raise RowError(name, "reserved", "a reward function receives the completion under this name; rename "
                                             "the column")
    return {**extra, "prompt": _prompt(_get(row, "prompt", m), fp), "answer": _text(str(answer), fa)}


NORMALISERS = {"text": _text_row, "alpaca": _alpaca, "prompt_completion": _prompt_completion,
               "messages": _messages_row, "sharegpt": _sharegpt, "preference": _preference,
               "implicit_preference": _implicit_preference, "prompt_answer": _prompt_answer}


def normalise(fmt: str, row, mapping: dict[str, str], where: str) -> tuple[dict | None, Problem | None]:
    """(canonical row, None) or (None, the problem)."""
    if not isinstance(row, dict):
        return None, Problem(where, "(row)", "wrong_type", f"expected a JSON object, got {type(row).__name__}")
    try:
        return NORMALISERS[fmt](row, mapping), None
    except RowError as e:
        return None, Problem(where, e.field, e.reason, e.detail)


# ---- what the workers need from a canonical row ---------------------------------------------------------------------
def texts_of(kind: str, row: dict):
    """Every text in a canonical row (tokenizer training)."""
    if kind == "pretrain":
        yield row["text"]
    elif kind == "sft":
        yield from (m["content"] for m in row["messages"])
    elif kind == "prompts":
        yield from (m["content"] for m in row["prompt"])
        yield row["answer"]
    else:
        yield from (m["content"] for k in ("prompt", "chosen", "rejected") for m in row[k])
