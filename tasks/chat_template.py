"""`model.chat_template`: the chat template a run uses when its input HF checkpoint has none.

The value is a Jinja template string, or a path to a template file (relative paths from the working directory, as
data globs are). It is checked once, when the config loads (it must parse and render a tiny conversation through
transformers' own sandboxed renderer), and written into the tokenizer that the data, rlhf and finetune stages use, so
the checkpoints they produce (and the server after them) carry it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

KEY = "model.chat_template"
FILE_NAME = "chat_template.jinja"
MAX_BYTES = 1 << 20
TINY_CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                     {"role": "assistant", "content": "Hi."}]


def looks_like_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def text_of(value: str) -> str:
    """The template text: the value itself, or the contents of the file it names."""
    if looks_like_template(value):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value!r} is neither a Jinja template (no '{{{{' or '{{%') nor a template file that exists")
    if path.stat().st_size > MAX_BYTES:
        raise ValueError(f"{path}: over {MAX_BYTES} bytes, not a chat template")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the template ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (at byte {e.start}), not a chat template") from None


def check(value: str) -> str:
    """The template text, once it parses and renders a system/user/assistant conversation that shows the user's and
    the assistant's words; ValueError saying why otherwise."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    text = text_of(value)
    # A path may name any file the user can read (a key, a password file): what it holds never goes into a message.
    quote = (lambda detail: f": {detail}") if looks_like_template(value) else (lambda detail: " (contents not shown)")
    if not text.strip():
        raise ValueError("the template is empty")
    try:
        rendered = render_jinja_template([TINY_CONVERSATION], chat_template=text, add_generation_prompt=True,
                                         bos_token="<s>", eos_token="</s>")[0][0]
    except TemplateSyntaxError as e:
        raise ValueError(f"does not parse as Jinja (template line {e.lineno}){quote(e.message)}") from None
    except Exception as e:  # the template's own raise_exception(), or an error inside an expression
        raise ValueError(f"the template fails to render a system/user/assistant conversation"
                         f"{quote(f'{type(e).__name__}: {e}')}") from None
    missing = [m["role"] for m in TINY_CONVERSATION[1:] if m["content"] not in rendered]
    if missing:
        raise ValueError(f"the template renders a conversation without its {' and '.join(missing)} message"
                         f"{quote(repr(rendered[:120]))}")
    return text


def digest(value: str | None) -> str | None:
    """What fingerprints see of the key: the template's text, so an edited template file re-runs what used it."""
    return hashlib.sha256(text_of(value).encode()).hexdigest() if value else None


def write_if_missing(value: str | None, tokenizer_dir: Path) -> Path | None:
    """Write the configured template beside a tokenizer that has none; the file written, or None."""
    from conversions import durable, manifest as mf

    if not value or mf.chat_template_present(tokenizer_dir):
        return None
    return durable.write_text(Path(tokenizer_dir) / FILE_NAME, text_of(value))


def resolved(model: dict) -> dict:
    """The model section a stage receives: the template's text in place of a path (the stage may run elsewhere)."""
    value = model.get("chat_template")
    return {**model, "chat_template": text_of(value)} if value else dict(model)


def for_input(ctx) -> Path | None:
    """The configured template, written into the stage's work folder, when the stage's input checkpoint has none:
    the worker adds it to the input's tokenizer and to the checkpoint it writes. None when the input has its own."""
    from conversions import durable, manifest as mf

    value = ctx.model.get("chat_template")
    if not value or ctx.input is None or mf.chat_template_present(Path(ctx.input)):
        return None
    Path(ctx.work_dir).mkdir(parents=True, exist_ok=True)
    return durable.write_text(Path(ctx.work_dir) / FILE_NAME, text_of(value))


def missing_problem(stage: str, ctx, purpose: str) -> str | None:
    """The refusal when neither the input checkpoint nor the config has a chat template."""
    from conversions import manifest as mf

    if mf.chat_template_present(Path(ctx.input)) or ctx.model.get("chat_template"):
        return None
    return (f"{stage}: input {ctx.input} has no chat template to {purpose}; set {KEY} (a Jinja template, or the path "
            "to a .jinja file), or add chat_template.jinja to the checkpoint beside tokenizer_config.json")


# How many of a dataset's first rows the boundary check renders before launch (the worker checks every row).
BOUNDARY_ROWS = 64


def boundary_problem(stage: str, ctx, conversations: list[list[dict]]) -> str | None:
    """The refusal when the stage's chat template cannot train replies on the contexts engines serve (its generation
    prompt ends inside a token of the reply: tasks.chat), found on probe conversations and the given ones,
    naming the template: the config's, or the input checkpoint's own."""
    from transformers import AutoTokenizer

    from tasks import chat

    tok = AutoTokenizer.from_pretrained(str(ctx.input))
    source = f"the chat template of {ctx.input}"
    if not tok.chat_template and ctx.model.get("chat_template"):  # as the workers load it
        tok.chat_template, source = text_of(ctx.model["chat_template"]), KEY
    problem = chat.boundary_problem(tok, conversations)
    return f"{stage}: {source}: {problem}" if problem else None


def first_rows(path: Path, n: int = BOUNDARY_ROWS) -> list[dict]:
    import json

    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(rows) == n:
                break
            if line.strip():
                rows.append(json.loads(line))
    return rows
