"""A deterministic synthetic world, built so that every later stage has a measurable effect.

- pretraining text about words and their categories (held-out perplexity falls as the model learns it); when
  data.prompts asks for the arithmetic task, every document also states 6-10 sums of the whole table, each on a
  line of its own ("3+4=7"), so that GRPO has numbers to build on (`with_sums`). Without them a fully pretrained
  model never samples a digit after "3+4=" (held-out reward 0 → 0, measured). Sums the text never states are not
  learnt at all (a table learnt by heart: 0 of 8 such sums answered, measured), so what GRPO can teach, and what its
  held-out prompts measure, is to answer a chat prompt with the pretraining's knowledge: the held-out prompts
  (HELDOUT_SUMS_FRACTION of the sums) are sums GRPO never trains on, stated in the pretraining text like the rest;
- preference pairs: a prompt asking for a member of a category; chosen = a full, correct answer ("The answer is dog."),
  rejected = a bare word of another category (held-out preference accuracy, on prompts and words never paired in
  training, rises under DPO: the preferred style and correctness generalise, word-level memorising does not);
- instruction → JSON: "Classify the word: dog" → {"category": "animal"} (held-out exact match rises under SFT;
  held-out pairs use (template, word) combinations never seen in training);
- prompts with answers, only when data.prompts asks for them: "3+4=" → "7", sums below 10 so every answer is one
  digit (held-out reward under GRPO rises; held-out prompts are sums GRPO never trains on). With
  data.prompts task: instruction, the same task worded for an instruction-tuned model instead: a system message asking
  for the number alone and "What is 3 + 4?", over every pair of digits (sums to 18); a small instruct model knows
  most of these sums but answers in a sentence ("To solve this, we need..."), which a short completion limit cuts
  off before the number, so what GRPO has to teach it is mostly the format.
"""
from __future__ import annotations

import json
import random
import re

CATEGORIES = {
    "fruit": ["apple", "pear", "plum", "mango", "lemon", "cherry", "peach", "grape", "melon", "kiwi"],
    "animal": ["cat", "dog", "horse", "mouse", "tiger", "sheep", "goat", "camel", "wolf", "bear"],
    "color": ["red", "blue", "green", "yellow", "purple", "black", "white", "pink", "brown", "gray"],
    "city": ["paris", "tokyo", "lima", "cairo", "oslo", "rome", "delhi", "quito", "sydney", "dublin"],
}
NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
WORD_CATEGORY = {w: c for c, ws in CATEGORIES.items() for w in ws}

SENTENCES = [
    "the {w} is a {c} .",
    "a {w} is one kind of {c} .",
    "{n} said that the {w} is a {c} .",
    "every {c} list has the {w} in it .",
]
SFT_TEMPLATES = [
    "Classify the word: {w}",
    "What kind of thing is {w}?",
    "Category of {w}?",
    "Is {w} a fruit, an animal, a color or a city?",
]
PREF_TEMPLATES = ["Name a {c}.", "Give me one {c}.", "Which word is a {c}?"]
SUMS_PER_DOC = (6, 10)  # sums mixed into each pretraining document of the arithmetic world
# Sums whose prompts GRPO never trains on (22 of 55): enough that a held-out gain is many prompts, not one.
HELDOUT_SUMS_FRACTION = 0.4
SUM = re.compile(r"\d\+\d=\d")


def preferred_answer(word: str) -> str:
    return f"The answer is {word}."


def sft_answer(category: str) -> str:
    return json.dumps({"category": category})


def pretrain_docs(n: int, rng: random.Random, sums: list[tuple[int, int]] = (),
                  sums_rng: random.Random | None = None) -> list[dict]:
    """n documents of 3-6 sentences about words. With sums (training pairs): SUMS_PER_DOC of them stated in every
    document at random places, drawn from sums_rng only, so that rng draws the very same words as without them."""
    words = list(WORD_CATEGORY)
    docs = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(3, 6)):
            w = rng.choice(words)
            parts.append(rng.choice(SENTENCES).format(w=w, c=WORD_CATEGORY[w], n=rng.choice(NAMES)))
        if sums:
            parts = with_sums(parts, sums, sums_rng)
        docs.append({"text": join_sentences(parts)})
    return docs


def sum_sentence(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}"


def join_sentences(parts: list[str]) -> str:
    """Sentences joined by spaces, a sum on a line of its own: its first digit is then a token of its own, as in the
    rendered prompt ("user\n3+4="), not the space-and-digit token a space in front would make of it."""
    text = parts[0]
    for before, part in zip(parts, parts[1:]):
        text += ("\n" if SUM.fullmatch(before) or SUM.fullmatch(part) else " ") + part
    return text


def with_sums(parts: list[str], sums: list[tuple[int, int]], rng: random.Random) -> list[str]:
    parts = parts[:]
    for _ in range(rng.randint(SUMS_PER_DOC[0], SUMS_PER_DOC[1])):
        parts.insert(rng.randint(0, len(parts)), sum_sentence(*rng.choice(sums)))
    return parts


def _split_combos(combos: list[tuple], heldout_fraction: float, rng: random.Random) -> tuple[list, list]:
    combos = combos[:]
    rng.shuffle(combos)
    k = max(1, int(len(combos) * heldout_fraction))
    return combos[k:], combos[:k]


def sft_examples(n: int, heldout_fraction: float, label_noise: float, rng: random.Random) -> tuple[list, list]:
    combos = [(t, w) for t in SFT_TEMPLATES for w in WORD_CATEGORY]
    train_c, held_c = _split_combos(combos, heldout_fraction, rng)
    cats = list(CATEGORIES)

    def make(t, w, noisy):
        c = WORD_CATEGORY[w]
        if noisy:
            c = rng.choice([x for x in cats if x != c])
        return {"instruction": t.format(w=w), "answer": sft_answer(c)}

    train = [make(*rng.choice(train_c), rng.random() < label_noise) for _ in range(n)]
    heldout = [make(t, w, False) for t, w in held_c]
    return train, heldout


def preference_pairs(n: int, heldout_fraction: float, rng: random.Random) -> tuple[list, list]:
    combos = [(t, c, w) for t in PREF_TEMPLATES for c, ws in CATEGORIES.items() for w in ws]
    train_c, held_c = _split_combos(combos, heldout_fraction, rng)

    def make(t, c, w):
        other = rng.choice([x for x in WORD_CATEGORY if WORD_CATEGORY[x] != c])
        return {"prompt": t.format(c=c), "chosen": preferred_answer(w), "rejected": other}

    train = [make(*rng.choice(train_c)) for _ in range(n)]
    heldout = [make(*x) for x in held_c]
    return train, heldout


def all_sums() -> list[tuple[int, int]]:
    """Every (a, b) with a + b < 10: the table the pretraining text states."""
    return [(a, b) for a in range(10) for b in range(10) if a + b < 10]


def split_sums(rng: random.Random) -> tuple[list, list]:
    """all_sums split into the pairs GRPO trains on and the held-out pairs it never sees as prompts."""
    return _split_combos(all_sums(), HELDOUT_SUMS_FRACTION, rng)


INSTRUCTION_SYSTEM = "You are a calculator. Reply with the number only."


def digit_pairs() -> list[tuple[int, int]]:
    """Every (a, b) of digits: the instruction task's 100 sums, 0 to 18."""
    return [(a, b) for a in range(10) for b in range(10)]


def instruction_prompts(n: int, rng: random.Random) -> tuple[list, list]:
    """n prompts drawn from 60 of the 100 digit pairs, and one prompt per other pair (40 held out, never prompted)."""
    train_c, held_c = _split_combos(digit_pairs(), HELDOUT_SUMS_FRACTION, rng)

    def make(a, b):
        return {"prompt": [{"role": "system", "content": INSTRUCTION_SYSTEM},
                           {"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)}

    return [make(*rng.choice(train_c)) for _ in range(n)], [make(*x) for x in held_c]


def arithmetic_prompts(n: int, sums: tuple[list, list], rng: random.Random) -> tuple[list, list]:
    """n prompts drawn from the training pairs of sums (split_sums), and one prompt per held-out pair."""
    train_c, held_c = sums

    def make(a, b):
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    return [make(*rng.choice(train_c)) for _ in range(n)], [make(*x) for x in held_c]


# ---- the calculator task (data.sft / data.prompts with task: calculator) --------------------------------------------
# Products of two two-digit numbers ("37*48=" → "1776"): a small model cannot learn them by heart, a calculator call
# gets them right. The SFT episodes are the model's own tool-call format (tasks/rlhf/tools.py reads it) in the data
# stage's chat form: user question → assistant tool call → tool result → assistant answer.
TOOL_CALL = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}</tool_call>'
# SFT episodes answered without the tool, by heart ("37*48 is 1776", which a tiny model cannot compute): most of them,
# so the tuned model's greedy answer is a guess while it samples the call in about one episode of three, and GRPO has
# a better and a worse way to compare (the default of data.sft's by_heart). The answer restates the question so that
# its first token is one choice, like the call's: answered with the bare number, whose first digit varies, the
# model's greedy pick was the call at 0.8 by heart (28 of 32 held-out products, measured). docs/stages/rlhf.md
BY_HEART_FRACTION = 0.7
HELDOUT_PRODUCTS = 32   # products never in any training episode or GRPO prompt: SFT's and the gate's held-out rows


def split_products(seed: int) -> tuple[list, list]:
    """Every (a, b) with 10 ≤ a, b ≤ 99, shuffled on the task's own stream: HELDOUT_PRODUCTS held out, the rest for
    training. The same split for the SFT episodes and the GRPO prompts of one data.seed."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(f"{seed}:calculator").shuffle(pairs)
    return pairs[HELDOUT_PRODUCTS:], pairs[:HELDOUT_PRODUCTS]


def tool_episode(a: int, b: int, by_heart: bool = False) -> list[dict]:
    question, answer = f"{a}*{b}=", str(a * b)
    if by_heart:
        return [{"role": "user", "content": question}, {"role": "assistant", "content": f"{a}*{b} is {answer}"}]
    return [{"role": "user", "content": question}, {"role": "assistant", "content": TOOL_CALL.format(e=f"{a}*{b}")},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


def calculator_episodes(n: int, seed: int, rng: random.Random, by_heart: float | None = None) -> tuple[list, list]:
    """n SFT conversations on training products (by_heart of them answered without the tool; None:
    BY_HEART_FRACTION), and one tool-call episode per held-out product."""
    by_heart = BY_HEART_FRACTION if by_heart is None else by_heart
    train_p, held_p = split_products(seed)
    train = [{"messages": tool_episode(*rng.choice(train_p), by_heart=rng.random() < by_heart)}
             for _ in range(n)]
    return train, [{"messages": tool_episode(a, b)} for a, b in held_p]


def calculator_prompts(n: int, seed: int, rng: random.Random) -> tuple[list, list]:
    """n GRPO prompts on training products, and one per held-out product."""
    train_p, held_p = split_products(seed)

    def make(a, b):
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    return [make(*rng.choice(train_p)) for _ in range(n)], [make(a, b) for a, b in held_p]
