"""SGLang frontend program against a live server (runs in the sglang runtime: it imports sglang).

    python sgl_program.py --spec SPEC.json       (an events.SglProgramSpec: url, key_file, n)

A `sgl.function` with a regex-constrained `sgl.gen` and a `sgl.select` over choices, run as a batch over
`sgl.RuntimeEndpoint`. Prints one `result` event with a verify-style check.
"""
from __future__ import annotations

import re
import sys

from tasks import events

CATEGORIES = ["fruit", "animal", "color", "city"]
WORDS = ["apple", "tiger", "paris", "purple", "mango", "wolf", "lima", "green"]
CODE_REGEX = r"[A-Z]{3}-[0-9]{2}"


def main() -> int:
    args = events.read_typed_spec(events.SglProgramSpec)

    import sglang as sgl

    @sgl.function
    def label(s, word):
        s += f"Word: {word}\nCategory: "
        s += sgl.select("category", choices=CATEGORIES)
        s += "\nCode: " + sgl.gen("code", regex=CODE_REGEX, max_tokens=16, temperature=1.0)

    backend = sgl.RuntimeEndpoint(args.url, api_key=args.key_file.read_text().strip())
    words = (WORDS * args.n)[:args.n]
    states = label.run_batch([{"word": w} for w in words], backend=backend, num_threads=2)
    problems = []
    for w, st in zip(words, states):
        cat, code = st["category"], st["code"]
        if cat not in CATEGORIES:
            problems.append(f"{w}: choice {cat!r} not among {CATEGORIES}")
        if not re.fullmatch(CODE_REGEX, code):
            problems.append(f"{w}: gen {code!r} does not match {CODE_REGEX}")
    examples = ", ".join(f"{w}->{st['category']}/{st['code']}" for w, st in list(zip(words, states))[:3])
    detail = "; ".join(problems) if problems else (
        f"{len(words)} programs over RuntimeEndpoint: select in {CATEGORIES}, gen matches {CODE_REGEX} ({examples})")
    events.emit("result", check={"name": "smoke.sgl_frontend", "passed": not problems, "detail": detail})
    return 0


if __name__ == "__main__":
    sys.exit(main())
