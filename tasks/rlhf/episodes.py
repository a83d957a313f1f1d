"""Multi-turn GRPO episodes with tools (rlhf.tools), run inside the TRL worker: generate a model turn, read it for a
tool call (tasks/rlhf/tools.py), run the tool, append its result as a `tool` turn rendered by the checkpoint's chat
template, and let the model continue until it answers or a limit ends the episode.

TRL 1.16's GRPOTrainer has its own tool loop (`tools=`), but it keeps going after a failed call (the error becomes
the tool's reply), has no timeout, and needs a template that renders structured `tool_calls` and a response parser:
the tiny ChatML template has neither. So the episodes come in through TRL's `rollout_func`, whose `env_mask` TRL
multiplies into the loss mask: only the model's own tokens are trained on, tool turns are context.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from conversions import durable
from tasks import chat
from tasks.rlhf.environment import EnvironmentCode, EpisodeEnvironment, Reply
from tasks.rlhf.tools import EpisodeEnd, parse_tool_call, run_tool


@dataclass
class Episode:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)    # after the prompt: model turns and tool turns
    mask: list[int] = field(default_factory=list)   # 1: a model token (trained), 0: a tool turn's (context only)
    turns: int = 0
    tool_calls: int = 0
    reply: str = ""                                  # the last model turn, special tokens removed: what rewards score
    end: EpisodeEnd | None = None
    environment_reward: float = 0.0                  # the sum of rlhf.environment's step rewards
    environment: EpisodeEnvironment | None = None


@dataclass(frozen=True)
class Limits:
    tools: tuple[str, ...]
    max_turns: int
    max_tokens: int        # max_completion_length: model and tool tokens of one episode
    tool_timeout_s: float  # and of one call of the environment
    environment: EnvironmentCode | None = None


def tool_turn_text(tok, result: str, role: str = "tool") -> str:
    """What the chat template writes after a model turn that ends with its end-of-turn token, for a tool result (or
    the environment's user message), through the next assistant header (ChatML:
    `\\n<|im_start|>tool\\n7<|im_end|>\\n<|im_start|>assistant\\n`)."""
    convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = tok.apply_chat_template(convo, tokenize=False)
    after = tok.apply_chat_template(convo + [{"role": role, "content": result}], tokenize=False,
                                    add_generation_prompt=True)
    end_id = chat.end_of_turn_id(tok)
    end = tok.convert_ids_to_tokens(end_id) if end_id is not None else tok.eos_token
    cut = before.rindex(end) + len(end)
    if not after.startswith(before[:cut]):
        raise ValueError("the chat template renders the conversation differently once a tool turn follows")
    return after[cut:]


class EpisodeRunner:
    """Runs a batch of episodes with one model: every live episode's next turn in one `generate` call."""

    def __init__(self, tok, limits: Limits):
        self.tok, self.limits = tok, limits
        self.stop_ids = sorted({tok.eos_token_id, *([chat.end_of_turn_id(tok)] if chat.end_of_turn_id(tok) is not None
                                                     else [])})

    @torch.no_grad()
    def run(self, model, prompts: list[str], generation: dict, rows: list[tuple[str, dict]] = ()) -> list[Episode]:
        """One episode per rendered prompt; rows: each prompt's (user text, other columns, messages): the environment's
        reset is given the first two, and the messages are rendered again when reset returns a first message."""
        episodes = [Episode(self.tok(p)["input_ids"]) for p in prompts]  # as TRL tokenizes a string prompt
        try:
            if self.limits.environment is not None:
                self.reset_environments(episodes, rows)
            while live := [e for e in episodes if e.end is None]:
                for episode, turn in zip(live, self.next_turns(model, live, generation)):
                    self.take_turn(episode, turn)
        finally:
            for e in episodes:
                if e.environment is not None:
                    e.environment.close()
        return episodes

    def reset_environments(self, episodes: list[Episode], rows: list[tuple[str, dict]]) -> None:
        for e in episodes:  # the children start side by side
            e.environment = EpisodeEnvironment(self.limits.environment, self.limits.tool_timeout_s)
        for e, (text, fields, messages) in zip(episodes, rows, strict=True):
            reset = e.environment.reset(text, fields)
            e.end = environment_failure(reset)
            if e.end is None and reset.value is not None:
                e.prompt_ids = self.tok(first_message_prompt(self.tok, messages, reset.value))["input_ids"]

    def next_turns(self, model, live: list[Episode], generation: dict) -> list[list[int]]:
        seqs = [e.prompt_ids + e.ids for e in live]
        budgets = [self.limits.max_tokens - len(e.ids) for e in live]
        width = max(len(s) for s in seqs)
        pad = self.tok.pad_token_id
        ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
        device = next(model.parameters()).device
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **{
            **generation, "max_new_tokens": max(budgets), "eos_token_id": self.stop_ids, "pad_token_id": pad})
        turns = []
        for row, budget in zip(out[:, width:].tolist(), budgets):
            stop = next((i for i, t in enumerate(row[:budget]) if t in self.stop_ids), None)
            turns.append(row[:stop + 1] if stop is not None else row[:budget])
        return turns

    def take_turn(self, e: Episode, turn: list[int]) -> None:
        e.ids += turn
        e.mask += [1] * len(turn)
        e.turns += 1
        e.reply = self.tok.decode(turn, skip_special_tokens=True)
        if not turn or turn[-1] not in self.stop_ids:
            e.end = EpisodeEnd.LENGTH
            return
        parsed = parse_tool_call(e.reply, self.limits.tools)
        if parsed.problem:
            e.end = EpisodeEnd.MALFORMED_TOOL_CALL
            return
        if parsed.call is None:
            self.answer(e)
            return
        e.tool_calls += 1
        if e.turns >= self.limits.max_turns:
            e.end = EpisodeEnd.MAX_TURNS  # no turn left to read the result in
            return
        result = run_tool(parsed.call, self.limits.tool_timeout_s)
        if result.end is not None:
            e.end = result.end
            return
        self.append_turn(e, result.text, "tool")

    def answer(self, e: Episode) -> None:
        """A model turn without a tool call: the end, unless the environment answers with the next user message."""
        if e.environment is None:
            e.end = EpisodeEnd.FINISHED
            return
        stepped = e.environment.step(e.reply)
        if (failed := environment_failure(stepped)) is not None:
            e.end = failed
            return
        message, reward, done = stepped.value
        e.environment_reward += reward
        if done or message is None:
            e.end = EpisodeEnd.FINISHED
        elif e.turns >= self.limits.max_turns:
            e.end = EpisodeEnd.MAX_TURNS
        else:
            self.append_turn(e, message, "user")

    def append_turn(self, e: Episode, text: str, role: str) -> None:
        """A tool's or the environment's turn: context for the model's next turn, never trained on."""
        ids = self.tok(tool_turn_text(self.tok, text, role), add_special_tokens=False)["input_ids"]
        if len(e.ids) + len(ids) >= self.limits.max_tokens:  # no token left for the model after it
            e.end = EpisodeEnd.LENGTH
            return
        e.ids += ids
        e.mask += [0] * len(ids)


def first_message_prompt(tok, messages: list[dict], first: str) -> str:
    """The rendered prompt with the environment's first message in place of its last user message (the messages
    before it, a system prompt, stay), tokenized then as TRL tokenizes a string prompt."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "user")
    convo = [*messages[:last], {**messages[last], "content": first}, *messages[last + 1:]]
    return chat.for_special_tokens(tok, chat.prompt_text(tok, convo))


def environment_failure(reply: Reply) -> EpisodeEnd | None:
    if reply.timed_out:
        return EpisodeEnd.ENVIRONMENT_TIMED_OUT
    return EpisodeEnd.ENVIRONMENT_RAISED if reply.raised is not None else None


def summary(episodes: list[Episode]) -> dict:
    """Counts per end, model turns and tool calls of a set of episodes."""
    n = max(len(episodes), 1)
    ends = Counter(e.end.value for e in episodes)
    return {"episodes": len(episodes), "ends": {end.value: ends.get(end.value, 0) for end in EpisodeEnd},
            "tool_calls": sum(e.tool_calls for e in episodes), "turns_per_episode": sum(e.turns for e in episodes) / n}


def add_up(total: dict, part: dict) -> dict:
    """Two summaries of episodes as one."""
    if not total:
        return part
    n = total["episodes"] + part["episodes"]
    return {"episodes": n, "ends": {k: total["ends"][k] + part["ends"][k] for k in total["ends"]},
            "tool_calls": total["tool_calls"] + part["tool_calls"],
            "turns_per_episode": (total["turns_per_episode"] * total["episodes"] +
                                  part["turns_per_episode"] * part["episodes"]) / max(n, 1)}


TOTALS_FILE = "baton_episodes.json"  # in each TRL checkpoint: the run's training episodes through its step


def save_totals(checkpoint: Path, totals: dict) -> None:
    """The run's training episodes so far, into a checkpoint before it is sealed, so a resume counts the steps
    before it too (TRL's trainer state has no place for them)."""
    durable.write_json(Path(checkpoint) / TOTALS_FILE, totals)


def load_totals(checkpoint: Path) -> dict:
    """A sealed checkpoint's training episodes ({} when it has none: a run without episodes)."""
    path = Path(checkpoint) / TOTALS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def rollout_func(runner: EpisodeRunner, totals: dict, rows: dict[str, tuple[str, dict]]):
    """TRL's rollout_func: one episode per prompt it is given (TRL repeats each prompt num_generations times), sampled
    as TRL samples (its generation kwargs); rows: each rendered prompt's (user text, other columns, messages), for the
    environment (TRL hands the function prompts only). Each step's episodes are logged (train/episodes_*) and added
    to totals."""
    def rollout(prompts: list[str], trainer) -> dict:
        model = trainer.accelerator.unwrap_model(trainer.model)
        episodes = runner.run(model, prompts, {k: v for k, v in trainer.generation_kwargs.items()
                                                if k not in ("max_new_tokens", "eos_token_id", "pad_token_id")},
                              [rows[p] for p in prompts])
        part = summary(episodes)
        totals.update(add_up(dict(totals), part))
        metrics = trainer._metrics["train" if model.training else "eval"]
        for end, count in part["ends"].items():
            metrics[f"episodes/{end}"].append(count / max(part["episodes"], 1))
        metrics["episodes/tool_calls"].append(part["tool_calls"] / max(part["episodes"], 1))
        metrics["episodes/turns"].append(part["turns_per_episode"])
        for e in episodes:
            if not e.ids:  # ended before its first turn (its environment failed): TRL needs a token, train none
                e.ids, e.mask = [runner.stop_ids[0]], [0]
        return {"prompt_ids": [e.prompt_ids for e in episodes], "completion_ids": [e.ids for e in episodes],
                "logprobs": None, "env_mask": [e.mask for e in episodes],
                "final_reply": [e.reply for e in episodes],
                "environment_reward": [e.environment_reward for e in episodes]}

    return rollout
