"""An Ollama `Modelfile` beside an exported GGUF file: FROM the file, TEMPLATE the checkpoint's chat template in
Ollama's Go template language, PARAMETER stop for each stop token.

No well-kept Python renderer of Go templates exists, so a TEMPLATE is never translated from Jinja: each known family
(ChatML, which the data stage's own template is; Gemma) has its Go template written out once below, beside the turn
format it renders. The checkpoint's Jinja template is rendered (transformers' sandboxed renderer) on probe
conversations and must give exactly that turn format; any other template gets no Modelfile, and the reason is
recorded in the export's manifest.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MODELFILE = "Modelfile"
# user/assistant turns (the conversations both templates render alike), ending with a user turn: generation prompt
PROBES = ([{"role": "user", "content": "Say hi."}],
          [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
           {"role": "user", "content": "Again, twice."}])


@dataclass(frozen=True)
class Family:
    name: str
    render: Callable[[list[dict], str], str]   # (messages, bos token) -> the prompt, generation prompt included
    end_of_turn: str
    go_template: str                           # Ollama's TEMPLATE, rendering the same turns (BOS is llama.cpp's)


def _chatml(messages: list[dict], bos: str) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def _gemma(messages: list[dict], bos: str) -> str:
    turns = "".join(f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{m['content']}"
                    "<end_of_turn>\n" for m in messages)
    return f"{bos}{turns}<start_of_turn>model\n"


FAMILIES = (
    Family("chatml", _chatml, "<|im_end|>",
           "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n"),
    Family("gemma", _gemma, "<end_of_turn>",
           '{{- range .Messages }}<start_of_turn>{{ if eq .Role "assistant" }}model{{ else }}{{ .Role }}{{ end }}\n'
           "{{ .Content }}<end_of_turn>\n{{ end }}<start_of_turn>model\n"),
)


def family_of(template: str, bos: str, eos: str) -> Family | None:
    """The known family whose turn format the Jinja template renders on every probe, or None."""
    from transformers.utils.chat_template_utils import render_jinja_template

    for family in FAMILIES:
        try:
            rendered = [render_jinja_template([p], chat_template=template, add_generation_prompt=True,
                                              bos_token=bos, eos_token=eos)[0][0] for p in PROBES]
        except Exception:  # noqa: BLE001 - a template that cannot render the probe is no family's
            return None
        if rendered == [family.render(p, bos) for p in PROBES]:
            return family
    return None


def modelfile(src: Path, gguf_name: str) -> tuple[str | None, str]:
    """(the Modelfile's text, the family) for the HF checkpoint src, or (None, why there is none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    template = tokenizer.chat_template
    if not template:
        return None, "no Modelfile: the checkpoint has no chat template"
    family = family_of(template, tokenizer.bos_token or "", tokenizer.eos_token or "")
    if family is None:
        return None, ("no Modelfile: the chat template renders as none of the known families "
                      f"({', '.join(f.name for f in FAMILIES)})")
    stops = [family.end_of_turn, *(t for t in stop_tokens(src, tokenizer) if t != family.end_of_turn)]
    if odd := [t for t in stops if not t or '"' in t or any(ord(ch) < 32 for ch in t)]:
        return None, f"no Modelfile: stop token(s) {odd} cannot be written as a quoted Modelfile value"
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{family.go_template}"""', *(f'PARAMETER stop "{t}"' for t in stops)]
    return "\n".join(lines) + "\n", family.name


def stop_tokens(src: Path, tokenizer) -> list[str]:
    """The text of each stop token of the checkpoint's generation config (its eos ids), in order."""
    try:
        generation = json.loads((Path(src) / "generation_config.json").read_text())
    except (OSError, ValueError):
        generation = {}
    ids = generation.get("eos_token_id", tokenizer.eos_token_id)
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    return [tokenizer.convert_ids_to_tokens(i) for i in ids]
