"""Partial credit for configs/tiny-tools.yaml's GRPO: the share of the product's digits that the answer's last number
has in the right places. The tuned model's wrong answers are near-copies of the tool's result (6721 for 6723), which
exact match scores 0 like any other; this gives GRPO a difference to compare within a group."""
import re


def digits_right(prompt, completion, answer, **row):
    numbers = re.findall(r"\d+", completion)
    if not numbers:
        return 0.0
    got, want = numbers[-1], str(answer)
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
