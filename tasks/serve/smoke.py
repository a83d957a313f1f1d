"""Smoke checks against a live OpenAI-compatible server. Each returns verify-style checks {"name","passed","detail"}.

They hold for a random-init model too: nothing here needs the model to be good, only the server to be right.
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import requests

from conversions.verify import check
from tasks.serve import engines

CATEGORIES = ["fruit", "animal", "color", "city"]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"category": {"type": "string", "enum": CATEGORIES},
                   "word": {"type": "string", "maxLength": 12}},
    "required": ["category", "word"],
    "additionalProperties": False,
}
REGEX = r"(fruit|animal|color|city): [a-z]{2,8}"
JSON_ENGINES = ("vllm", "sglang", "llamacpp")  # those asked for JSON-schema answers
REGEX_ENGINES = ("vllm", "sglang")  # and for regex ones (llama-server takes no regex, only GBNF grammars)
# llama-server's grammar lets a free JSON string end up as bytes that are not valid UTF-8 (a random-init model's byte
# tokens; its chat route then fails the request: 500 "does not match the expected peg-native format"): its string is
# asked in ASCII letters. Its grammar also allows runs of whitespace between the tokens (the HF engines run with
# whitespace disabled), so its answers may take twice the tokens.
JSON_REQUEST = {"llamacpp": ({**JSON_SCHEMA, "properties": {**JSON_SCHEMA["properties"],
                                                            "word": {"type": "string", "pattern": "^[a-z]{1,12}$"}}},
                             2)}
WORDS = ["apple", "tiger", "paris", "purple", "mango", "wolf", "lima", "green", "kiwi", "bear"]


@dataclass
class Endpoint:
    engine: str
    base_url: str
    api_key: str
    model: str
    timeout: float = 120.0
    chat_params: dict = field(default_factory=dict)  # extra request fields on every chat call (e.g. prompt_logprobs)

    def post(self, path: str, body: dict, key: str | None = "default", **kw) -> requests.Response:
        return requests.post(self.base_url + path, json=body, headers=self._auth(key), timeout=self.timeout, **kw)

    def get(self, path: str, key: str | None = "default") -> requests.Response:
        return requests.get(self.base_url + path, headers=self._auth(key), timeout=self.timeout)

    def _auth(self, key: str | None) -> dict:
        key = self.api_key if key == "default" else key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def chat(self, content: str, **params) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": content}], **self.chat_params, **params}
        r = self.post("/v1/chat/completions", body)
        r.raise_for_status()
        return r.json()


def guarded(name: str, fn, *args) -> dict:
    """fn(*args), a check; a crash inside it (an HTTP 500, a refused connection) is that check failing, with the
    reason, and the checks after it still run."""
    try:
        return fn(*args)
    except Exception as e:
        return check(name, False, f"{type(e).__name__}: {e}"[:500])


def endpoint_checks(ep: Endpoint, tokenizer, max_tokens: int) -> list[dict]:
    """What every engine's server is first asked, each guarded: /v1/models, 401 without the key, a chat completion."""
    return [guarded("smoke.models", models, ep), guarded("smoke.auth_401", unauthorized, ep),
            guarded("smoke.chat", chat, ep, tokenizer, max_tokens)]


def models(ep: Endpoint) -> dict:
    r = ep.get("/v1/models")
    ids = [m.get("id") for m in r.json().get("data", [])] if r.ok else []
    return check("smoke.models", r.status_code == 200 and ep.model in ids,
                 f"GET /v1/models -> {r.status_code}, models {ids}")


def unauthorized(ep: Endpoint) -> dict:
    body = {"model": ep.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    codes = {"models, no key": ep.get("/v1/models", key=None).status_code,
             "chat, no key": ep.post("/v1/chat/completions", body, key=None).status_code,
             "chat, wrong key": ep.post("/v1/chat/completions", body, key="not-the-key").status_code}
    return check("smoke.auth_401", all(c == 401 for c in codes.values()),
                 ", ".join(f"{k}: {v}" for k, v in codes.items()))


def chat(ep: Endpoint, tokenizer, max_tokens: int) -> dict:
    """A chat completion whose prompt token count equals HF's chat template rendering: the template was applied."""
    from tasks.serve.reference import chat_prompt_ids

    text = "Classify the word: apple"
    expected = len(chat_prompt_ids(tokenizer, text))
    try:
        res = ep.chat(text, max_tokens=max_tokens, temperature=0)
    except requests.RequestException as e:
        return check("smoke.chat", False, f"chat completion failed: {e}")
    msg = res["choices"][0]["message"].get("content")
    got = res.get("usage", {}).get("prompt_tokens")
    ok = isinstance(msg, str) and got == expected
    return check("smoke.chat", ok, f"prompt_tokens {got} (HF chat template: {expected}), "
                                   f"finish {res['choices'][0].get('finish_reason')}, answer {msg!r:.60}")


def json_schema(ep: Endpoint, n: int, max_tokens: int) -> tuple[dict, float]:
    """n sampled answers under a JSON schema (the engine's: JSON_REQUEST): each must pass strict json.loads and
    jsonschema validation."""
    import jsonschema

    schema, token_factor = JSON_REQUEST.get(ep.engine, (JSON_SCHEMA, 1))
    max_tokens *= token_factor
    fmt = {"type": "json_schema", "json_schema": {"name": "classification", "schema": schema, "strict": True}}
    valid, lenient_only, failures = 0, 0, []
    for i in range(n):
        word = WORDS[i % len(WORDS)]
        res = ep.chat(f"Classify the word: {word}. Answer in JSON.", response_format=fmt, max_tokens=max_tokens,
                      temperature=1.0, seed=i)
        text = res["choices"][0]["message"].get("content") or ""
        try:
            jsonschema.validate(json.loads(text), schema)  # strict=True: no raw control characters
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            try:
                json.loads(text, strict=False)
                lenient_only += 1
            except json.JSONDecodeError:
                pass
            failures.append(f"{text!r:.80} ({type(e).__name__})")
    rate = valid / n
    detail = f"{valid}/{n} strictly valid ({lenient_only} only with strict=False)"
    if failures:
        detail += "; e.g. " + failures[0]
    return check("smoke.json_schema", rate == 1.0, detail), rate


def regex(ep: Endpoint, n: int, max_tokens: int) -> dict:
    bad = []
    for i in range(n):
        res = ep.chat(f"Classify the word: {WORDS[i % len(WORDS)]}", max_tokens=max_tokens, temperature=1.0, seed=i,
                      **engines.structured(ep.engine, "regex", REGEX))
        text = res["choices"][0]["message"].get("content") or ""
        if not re.fullmatch(REGEX, text):
            bad.append(text)
    return check("smoke.regex", not bad, f"{n - len(bad)}/{n} answers match {REGEX}" +
                 (f"; e.g. {bad[0]!r:.60}" if bad else ""))


def greedy_ids(ep: Endpoint, prompt_ids: list[int], n_tokens: int, **sampling) -> list[int]:
    """Greedy continuation of token ids, EOS ignored, as token ids (each engine has its own field for them)."""
    if ep.engine == "sglang":
        body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": n_tokens, "temperature": 0,
                                                             "ignore_eos": True, **sampling}}
        r = ep.post("/generate", body)
        r.raise_for_status()
        return list(r.json()["output_ids"])
    if ep.engine == "llamacpp":  # llama-server's own completion route takes and returns token ids
        body = {"prompt": prompt_ids, "n_predict": n_tokens, "temperature": 0, "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False, **sampling}
        r = ep.post("/completion", body)
        r.raise_for_status()
        return list(r.json()["tokens"])
    body = {"model": ep.model, "prompt": prompt_ids, "max_tokens": n_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **sampling}
    r = ep.post("/v1/completions", body)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


# Engines whose ignore_eos bans the stop tokens (llama-server: their logits to -inf) rather than only not stopping
# there: where HF's greedy choice is a stop token the engine must take another, so their parity ends before it.
BANS_STOP_TOKENS_UNDER_IGNORE_EOS = {"llamacpp"}


def greedy_parity(ep: Endpoint, reference: list[dict], model_dir, model=None, stop_ids: list[int] = (),
                  tolerance: float | None = None) -> dict:
    """The engine's greedy tokens against HF's: equal, token for token (tolerance None), or each within `tolerance`
    of HF's largest logit, HF fed the engine's own tokens (a quantised GGUF: conversions.gguf_export.ExportType
    served_logit_gap says why and how much)."""
    from tasks.serve.reference import top2_margin

    n_tokens = len(reference[0]["output_ids"])
    if tolerance is not None:
        continuations = [greedy_ids(ep, ref["prompt_ids"], n_tokens) for ref in reference]
        return tolerant_parity(ep.engine, reference, continuations, model, stop_ids, tolerance)
    compared = 0
    for ref in reference:
        want = ref["output_ids"]
        if ep.engine in BANS_STOP_TOKENS_UNDER_IGNORE_EOS:
            want = want[:next((i for i, t in enumerate(want) if t in stop_ids), len(want))]
        got = greedy_ids(ep, ref["prompt_ids"], n_tokens)[:len(want)]
        compared += len(want)
        if got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            margin = top2_margin(model_dir, ref["prompt_ids"] + want[:k], model)
            return check("smoke.greedy_parity", False,
                         f"{ref['instruction']!r}: first difference at token {k} (server {got[k:k + 3]}, HF "
                         f"{want[k:k + 3]}; HF top-2 logit gap there {margin:.2e})")
    if compared == len(reference) * n_tokens:
        return check("smoke.greedy_parity", True,
                     f"{len(reference)} prompts x {n_tokens} tokens identical to HF generate (fp32, greedy)")
    return check("smoke.greedy_parity", True,
                 f"{compared} tokens over {len(reference)} prompts identical to HF generate (fp32, greedy), each up "
                 f"to HF's first stop token {list(stop_ids)}, which {ep.engine} bans under ignore_eos")


def tolerant_parity(engine: str, reference: list[dict], continuations: list[list[int]], model, stop_ids: list[int],
                    tolerance: float) -> dict:
    """Teacher-forced: HF (`model`) reads each prompt followed by the engine's continuation; every engine token's HF
    logit must be within `tolerance` of HF's largest there (the stop tokens left out of that max where the engine
    bans them under ignore_eos). The first token beyond it fails the check, named with its position and the gap."""
    from tasks.serve.reference import logit_gaps

    excluded = list(stop_ids) if engine in BANS_STOP_TOKENS_UNDER_IGNORE_EOS else []
    worst, same, total = 0.0, 0, 0
    for ref, got in zip(reference, continuations):
        for k, (token, g) in enumerate(zip(got, logit_gaps(model, ref["prompt_ids"], got, excluded))):
            if g["gap"] > tolerance:
                return check("smoke.greedy_parity", False,
                             f"{ref['instruction']!r}: token {k}, the server's {token} (after {got[max(0, k - 2):k]}), "
                             f"is {g['gap']:.3f} below HF's largest logit there (HF's pick {g['hf_top']}; tolerance "
                             f"{tolerance:g}, HF fed the server's tokens)")
            worst, same, total = max(worst, g["gap"]), same + (token == g["hf_top"]), total + 1
    return check("smoke.greedy_parity", True,
                 f"{len(reference)} prompts x {len(continuations[0])} server tokens, HF (fp32) fed them: each within "
                 f"{tolerance:g} of HF's largest logit (the largest gap {worst:.3f}), {same} of {total} HF's own pick" +
                 (f" (stop tokens {excluded} left out: {engine} bans them under ignore_eos)" if excluded else ""))


def performance(ep: Endpoint, max_tokens: int = 64) -> dict:
    """TTFT of a streamed chat completion, and decode throughput of a non-streamed one (EOS ignored)."""
    body = {"model": ep.model, "messages": [{"role": "user", "content": "Classify the word: apple"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    with ep.post("/v1/chat/completions", body, stream=True) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                if ttft is None and delta and delta[0].get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
    body = {"model": ep.model, "prompt": "the apple is a", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    r = ep.post("/v1/completions", body)
    r.raise_for_status()
    seconds = time.perf_counter() - t0
    tokens = r.json().get("usage", {}).get("completion_tokens") or max_tokens
    return {"ttft_s": ttft, "tokens_per_s": tokens / seconds, "latency_s": seconds}


# ---- the serving contract: the server renders, stops and samples as the checkpoint was trained and configured -------
CONVERSATIONS = {
    "system+user": [{"role": "system", "content": "You sort words into categories."},
                    {"role": "user", "content": "Classify the word: apple"}],
    "user": [{"role": "user", "content": "Name a fruit."}],
    "multi-turn": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "fruit: mango"},
                   {"role": "user", "content": "And a city?"}],
}
# Each engine's tokenize route renders messages as its chat completions do (vLLM: generation prompt on, no extra
# special tokens by default; SGLang: "omitted, messages are rendered as for a chat completion").
TOKENIZE_PATH = {"vllm": "/tokenize", "sglang": "/v1/tokenize"}


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def served_rendering(ep: Endpoint, messages: list[dict]) -> list[int]:
    if ep.engine == "llamacpp":  # its template route, then its tokenizer as its chat route calls it (specials on)
        r = ep.post("/apply-template", {"messages": messages})
        r.raise_for_status()
        r = ep.post("/tokenize", {"content": r.json()["prompt"], "add_special": True, "parse_special": True})
        r.raise_for_status()
        return list(r.json()["tokens"])
    r = ep.post(TOKENIZE_PATH[ep.engine], {"model": ep.model, "messages": messages})
    r.raise_for_status()
    return list(r.json()["tokens"])


def chat_template_parity(ep: Endpoint, tokenizer) -> dict:
    """The engine's own rendering of fixed conversations equals the training rendering, token for token (a template
    without a system role skips the system conversation)."""
    from jinja2.exceptions import TemplateError

    from tasks.chat import reply_context_ids

    compared, skipped = [], []
    for name, messages in CONVERSATIONS.items():
        try:
            want = reply_context_ids(tokenizer, messages)
        except TemplateError:
            if messages[0]["role"] != "system":
                raise
            skipped.append(name)
            continue
        got = served_rendering(ep, messages)
        if got != want:
            k = first_difference(got, want)
            return check("smoke.chat_template_parity", False,
                         f"{name}: first difference at token {k} (server {got[k:k + 3]}, training {want[k:k + 3]}; "
                         f"{len(got)} vs {len(want)} tokens)")
        compared.append(f"{name} ({len(want)} tokens)")
    return check("smoke.chat_template_parity", True,
                 f"{ep.engine}'s rendering of {', '.join(compared)} identical to training's" +
                 (f"; {', '.join(skipped)} skipped: the template has no system role" if skipped else ""))


def template_markers(tokenizer) -> list[str]:
    """The special tokens the chat template writes (<|im_start|>, <|im_end|>, <start_of_turn>...). Added tokens that
    are plain text are not markers: Gemma's vocabulary adds runs of newlines and spaces as tokens of their own."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    added = tokenizer.added_tokens_decoder.values()
    tokens = set(tokenizer.all_special_tokens) | {t.content for t in added if t.special}
    return sorted(t for t in tokens if t and t in template)


STOP_PROBE = "Classify the word: apple"
# Greedy is argmax only when no penalty applies: the engines apply generation_config.json's penalties to chat
# completions (and vLLM to completions too), SGLang's /generate does not; neutral ones make both calls the same decode.
NO_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def first_stop(ep: Endpoint, prompt_ids: list[int], stop_ids: list[int], budget: int) -> tuple[int | None, str]:
    """Where the engine's greedy continuation of prompt_ids first reaches one of stop_ids, and which: (None, "")
    if not within budget tokens. Engines that ban the stop tokens under ignore_eos are let stop instead, and asked
    why they did (llama-server's stop_type "eos": an end-of-generation token, not among the tokens it returns)."""
    if ep.engine not in BANS_STOP_TOKENS_UNDER_IGNORE_EOS:
        free = greedy_ids(ep, prompt_ids, budget, **NO_PENALTIES)
        return next(((i, f"stop token {t}") for i, t in enumerate(free) if t in stop_ids), (None, ""))
    r = ep.post("/completion", {"prompt": prompt_ids, "n_predict": budget, "temperature": 0, "return_tokens": True,
                                "cache_prompt": False, **NO_PENALTIES})
    r.raise_for_status()
    out = r.json()
    if out.get("stop_type") != "eos":
        return None, ""
    return len(out["tokens"]), "an end-of-generation token (llama-server's stop_type eos)"


def stops_at_end_of_turn(ep: Endpoint, tokenizer, stop_ids: list[int], budget: int = 32) -> dict:
    """A greedy chat completion ends with finish_reason 'stop' at the model's first stop token (found in the engine's
    own greedy continuation with EOS ignored), and no template text leaks into the answer. A model that emits no
    stop token within `budget` tokens gets the leakage part only, and the detail says so."""
    from tasks.serve.reference import chat_prompt_ids

    at, stop = first_stop(ep, chat_prompt_ids(tokenizer, STOP_PROBE), stop_ids, budget)
    res = ep.chat(STOP_PROBE, max_tokens=(at + 8 if at is not None else budget), temperature=0, **NO_PENALTIES)
    choice = res["choices"][0]
    answer, finish = choice["message"].get("content") or "", choice.get("finish_reason")
    leaked = [m for m in template_markers(tokenizer) if m in answer]
    leak = f"template text {leaked} in the answer" if leaked else "no template text in the answer"
    if at is None:
        return check("smoke.stops_at_end_of_turn", not leaked,
                     f"greedy decoding reaches no stop token {stop_ids} within {budget} tokens, so only leakage was "
                     f"checked: {leak} (finish {finish}, answer {answer!r:.60})")
    ok = finish == "stop" and not leaked
    return check("smoke.stops_at_end_of_turn", ok,
                 f"the greedy reply reaches {stop} after {at} tokens: finish_reason {finish!r} "
                 f"(max_tokens {at + 8}), {leak} (answer {answer!r:.60})")


# The generation_config.json fields each engine applies as request defaults, and the line where it says which it took
# (vLLM 0.32 ModelConfig.get_diff_sampling_param; SGLang 0.5 ModelConfig.get_default_sampling_params).
DEFAULT_FIELDS = {"vllm": ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                           "top_p", "min_p", "max_new_tokens"),
                  "sglang": ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")}
DEFAULTS_REPORTED = {"vllm": re.compile(r"Default vLLM sampling parameters have been overridden by .*?: `(\{.*\})`"),
                     "sglang": re.compile(r"Using default chat sampling params from model generation config: (\{.*\})")}


def expected_defaults(engine: str, generation_config: dict | None) -> dict:
    gen = generation_config or {}
    want = {k: gen[k] for k in DEFAULT_FIELDS[engine] if gen.get(k) is not None}
    if "max_new_tokens" in want:  # vLLM's name for it
        want["max_tokens"] = want.pop("max_new_tokens")
    return want


def reported_defaults(engine: str, server_log: str) -> dict:
    """The sampling defaults the engine says it applies ({} when it reports none: it applies its own neutral ones)."""
    import ast

    found = DEFAULTS_REPORTED[engine].findall(server_log)
    return ast.literal_eval(found[-1]) if found else {}


def generation_defaults(engine: str, server_log: str, generation_config: dict | None) -> dict:
    """The sampling defaults the engine applies to requests equal the checkpoint's generation_config.json (as its
    manifest records it), for the fields the engine takes."""
    want, got = expected_defaults(engine, generation_config), reported_defaults(engine, server_log)
    if want == got:
        what = f"{got}" if got else "none (generation_config.json sets no sampling default the engine takes)"
        return check("smoke.generation_defaults", True, f"{engine} applies the checkpoint's sampling defaults: {what}")
    def shown(d: dict, k: str) -> str:
        return repr(d[k]) if k in d else "not set"

    fields = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    return check("smoke.generation_defaults", False, "; ".join(
        f"{k}: server default {shown(got, k)}, generation_config.json {shown(want, k)}" for k in fields))
