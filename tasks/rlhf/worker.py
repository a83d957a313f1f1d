"""TRL preference optimisation of an HF checkpoint: DPO, a reward model, or GRPO. Launched by tasks/rlhf/task.py:

    python worker.py --spec <work_dir>/rlhf_spec.json
    python -m torch.distributed.run --nproc_per_node 2 worker.py --spec ...      (2 CPU processes, gloo)

The recipe, top to bottom: read the preference pairs and chat-format them with the checkpoint's own template; measure
held-out preference accuracy of the input model; train with TRL (metrics streamed as events); save an HF folder with
the input's tokenizer and chat template; measure the same accuracy on the saved model; write the manifest.
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from conversions import hf, manifest as mf, sealed
from conversions.manifest import Format
from tasks import chat, events, resuming
from tasks.rlhf import engine_rollouts, episodes, rewards as rw
from tasks.rlhf.environment import EnvironmentCode

RANK = int(os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "1"))
SKIP_LOGS = {"epoch", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second",
             "train_loss"}
TRL_NAMES = {"loss": events.TRAIN_LOSS, "learning_rate": events.TRAIN_LR, "grad_norm": events.TRAIN_GRAD_NORM,
             "step_time": events.STEP_TIME_S, "rollout_time": events.ROLLOUT_TIME_S,
             "rollout_tokens_per_s": events.ROLLOUT_TOKENS_PER_S, "rollout_share": events.ROLLOUT_SHARE,
             "aux_loss": events.TRAIN_ROUTER_AUX_LOSS,  # an MoE's router load-balancing loss (TRL adds it to the loss)
             "sampling/sampling_logp_difference/mean": events.ROLLOUT_LOGP_DIFF}


# ---- main: the recipe; the phases follow in the order it runs them ---------------------------------------------------
def main(argv=None) -> None:
    a = events.read_typed_spec(events.RlhfSpec, argv)  # written by tasks/rlhf/task.py from the rlhf config
    from transformers import set_seed

    set_seed(a.seed)
    t0 = time.time()
    tok = load_tokenizer(a)
    if a.evaluate:  # an output another engine wrote (NeMo-RL): measure it the same way
        events.result(events.RlhfResult(**evaluate_only(a, tok), algorithm=a.algorithm))
        return
    if a.dataset == "prompts":
        recipe = prompts_recipe(a, tok)
    else:
        recipe = preference_recipe(a, tok, format_pairs(tok, read_jsonl(a.data / "preference" / "heldout.jsonl")))

    before = None
    if RANK == 0:
        before = recipe.measure_before()
        events.metric(0, eval_metrics(before))
    trainer, resumed_from = train(a, recipe)
    if RANK == 0:
        save_and_measure(a, recipe, trainer, before, resumed_from, t0)
    trainer.accelerator.wait_for_everyone()


def load_tokenizer(a: events.RlhfSpec):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a.input))
    if not tok.chat_template and a.chat_template:
        tok.chat_template = a.chat_template.read_text(encoding="utf-8")
    if not tok.chat_template:
        raise SystemExit(f"{a.input}: the tokenizer has no chat template; preference prompts cannot be formatted")
    return tok


def train(a: events.RlhfSpec, recipe: Recipe):
    """TRL's trainer on the recipe, resumed from the newest complete checkpoint of an earlier attempt. Returns the
    trainer and the step it resumed from (0: a fresh start)."""
    from transformers import PrinterCallback

    work = a.output.parent / (a.output.name + ".trl")
    # every rank reads (no process group exists yet; they read the same bytes, so they agree); rank 0 removes
    resume = resuming.resume_point(work, KIND, owner=RANK == 0).checkpoint if a.checkpoint_every > 0 else None
    trainer = recipe.make_trainer(work)
    trainer.remove_callback(PrinterCallback)  # our callback streams the same logs as events
    trainer.add_callback(checkpoint_callback(a.keep_checkpoints))
    trainer.add_callback(non_finite_callback(a.precision))
    resumed_from = KIND.step_of(resume) if resume else 0
    if resume:  # the episodes of the steps before the resume, which the rollouts from here add to
        TRAINING_EPISODES.update(episodes.load_totals(resume))
    if RANK == 0:
        events.started(resumed_from)
    with engine_rollouts.serving(trainer, a.rollout_engine_python, a.input, work,
                                 a.output.parent / "rollout_engine.log", a.max_completion_length):
        train_naming_a_full_disk(trainer, work, resume)
    trainer.accelerator.wait_for_everyone()
    return trainer, resumed_from


def save_and_measure(a: events.RlhfSpec, recipe: Recipe, trainer, before: dict, resumed_from: int,
                     t0: float) -> None:
    """Rank 0: the trained model as an HF folder with the input's tokenizer, measured as the input was; its manifest
    and the run's one result."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    a.output.mkdir(parents=True, exist_ok=True)
    with events.disk_full_exits(a.output, RANK):
        model.save_pretrained(str(a.output), safe_serialization=True)
        hf.copy_tokenizer(a.input, a.output, chat_template=a.chat_template)
        if a.chat_template and a.algorithm != "rm":  # model.chat_template: its end-of-turn token ends a reply too
            chat.add_end_of_turn_stop(a.output)      # (a reward model generates nothing; its policy gets it instead)
    seconds = round(time.time() - t0, 2)
    facts = {**recipe.evaluate(before), **recipe.facts, "seconds": seconds,
             "peak_mem_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # rank 0's peak RSS
    final = {facts["metric"]: facts["after"]}
    for key, name in FINAL_FACTS.items():
        if key in facts:
            final[name] = facts[key]
    events.metric(trainer.state.global_step, eval_metrics(final))
    write_manifest(a, a.output, {"eval": facts})
    events.result(events.RlhfResult(**facts, algorithm=a.algorithm, backend="trl", resumed_from=resumed_from,
                                     steps=trainer.state.global_step))


@dataclass
class Recipe:
    """What one run trains on and how it is measured: preference pairs (dpo, rm, grpo's preference reward) or prompts
    with answers (grpo with rlhf.rewards)."""

    make_trainer: Callable          # (work folder) → the TRL trainer
    measure_before: Callable        # () → the input's held-out facts
    evaluate: Callable              # (before) → the summary's eval facts, input and saved output
    facts: dict                     # about the training rows


def preference_recipe(a, tok, held_pairs: list[dict]) -> Recipe:
    train_pairs, overlong = drop_overlong(tok, format_pairs(tok, read_jsonl(a.data / "preference" / "train.jsonl")),
                                          a.max_seq_length, a.overlong)
    if not train_pairs:
        raise SystemExit(f"no preference pair fits in --max-seq-length {a.max_seq_length} ({overlong} over-long)")
    return Recipe(make_trainer=lambda work: TRAINERS[a.algorithm](a, tok, trl_pairs(tok, train_pairs), work),
                  measure_before=lambda: before_facts(a, tok, held_pairs),
                  evaluate=lambda before: evaluate(a, tok, held_pairs, before),
                  facts={"train_pairs": len(train_pairs),
                         ("overlong_dropped" if a.overlong == "drop" else "overlong_truncated"): overlong})


def prompts_recipe(a, tok) -> Recipe:
    train = format_prompts(tok, read_jsonl(a.data / "prompts" / "train.jsonl"), "train")
    held = format_prompts(tok, read_jsonl(a.data / "prompts" / "heldout.jsonl"), "heldout")
    return Recipe(make_trainer=lambda work: train_grpo_rewards(a, tok, train, work),
                  measure_before=lambda: rewards_before(a, tok, held),
                  evaluate=lambda before: evaluate_rewards(a, tok, held, before), facts={"train_prompts": len(train)})


def evaluate_only(a, tok) -> dict:
    """The held-out facts of the input and of the output in --output, trained elsewhere."""
    if a.dataset == "prompts":
        held = format_prompts(tok, read_jsonl(a.data / "prompts" / "heldout.jsonl"), "heldout")
        return evaluate_rewards(a, tok, held, rewards_before(a, tok, held))
    return evaluate(a, tok, format_pairs(tok, read_jsonl(a.data / "preference" / "heldout.jsonl")))


FINAL_FACTS = {"heldout_kl_to_reference": "heldout_kl_to_reference", "heldout_loss_after": "heldout_loss",
               "solved_after": "heldout_solved"}  # summary fact → its eval/ metric at the last step


# ---- TRL's logs as baton's metrics -----------------------------------------------------------------------------------
def trl_metric_name(trl_key: str) -> str:
    """TRL's log key as a baton metric name: the shared ones by name, the rest under train/ ('rewards/margins' →
    'train/rewards_margins')."""
    return TRL_NAMES.get(trl_key) or "train/" + re.sub(r"[^a-z0-9]+", "_", trl_key.lower()).strip("_")


def trl_metrics(logs: dict) -> dict:
    """TRL's numeric logs under baton's names; one a future TRL names outside the scheme goes to the log instead."""
    out = {}
    for key, value in logs.items():
        if key in SKIP_LOGS or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        problem = events.name_problem(trl_metric_name(key))
        if problem:
            print(f"TRL log {key}={value} (not streamed: {problem})", flush=True)
        else:
            out[trl_metric_name(key)] = value
    return out


def eval_metrics(facts: dict) -> dict:
    """Held-out facts (heldout_loss, heldout_pref_accuracy, ...) as eval/ metrics."""
    return {f"eval/{k}": v for k, v in facts.items() if isinstance(v, (int, float))}


# ---- data: the checkpoint's chat template around each prompt; completions end with its EOS ------------------------
def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_pairs(tok, rows: list[dict]) -> list[dict]:
    """Canonical pairs (message lists) → TRL's standard strings: the prompt through the generation prompt, each
    reply through its closing eos, all rendered by the checkpoint's own template."""
    out = []
    for r in rows:
        prompt, chosen = chat.completion(tok, r["prompt"], r["chosen"])
        _, rejected = chat.completion(tok, r["prompt"], r["rejected"])
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def trl_pairs(tok, pairs: list[dict]) -> list[dict]:
    """The pairs as TRL gets them: it tokenizes string prompts with the tokenizer's special tokens, so a template's
    leading BOS goes (the tokenizer adds it back) instead of reaching the model twice."""
    return [dict(p, prompt=chat.for_special_tokens(tok, p["prompt"])) for p in pairs]


def drop_overlong(tok, pairs: list[dict], max_len: int, overlong: str) -> tuple[list[dict], int]:
    """(the pairs to train on, how many are longer than max_len); those are dropped unless overlong is truncate."""
    def length(p, side):
        return len(tok(p["prompt"] + p[side], add_special_tokens=False)["input_ids"])

    long = [max(length(p, "chosen"), length(p, "rejected")) > max_len for p in pairs]
    kept = [p for p, too_long in zip(pairs, long) if not too_long] if overlong == "drop" else pairs
    return kept, sum(long)


# ---- held-out evaluation, defined on the model itself -------------------------------------------------------------
def _split_ids(tok, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt and completion, split where prompt and prompt+completion tokenizations diverge."""
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    full = tok(prompt + completion, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(p), len(full)) and p[n] == full[n]:
        n += 1
    return full[:n], full[n:]


EVAL_BATCH = 16  # held-out sequences per forward: one at a time, a tiny model's forwards are all thread overhead


def _padded(seqs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompt+completion sequences, right-padded: real tokens keep their positions."""
    width = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(seqs):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        mask[i, :len(p) + len(c)] = 1
    return ids, mask


@torch.no_grad()
def completion_logps(model, seqs: list[tuple[list[int], list[int]]], batch: int = EVAL_BATCH):
    """Per (prompt ids, completion ids), in order: the log-softmax rows that predict the completion's tokens, and
    those tokens. Batched forwards: other matrix shapes than one sequence at a time, so the last bits may differ
    (1e-7 relative, tests/test_rlhf_eval.py)."""
    for start in range(0, len(seqs), batch):
        chunk = seqs[start:start + batch]
        ids, mask = _padded(chunk)
        logits = model(ids, attention_mask=mask).logits
        for row, (p, c) in enumerate(chunk):
            yield (torch.log_softmax(logits[row, len(p) - 1:len(p) + len(c) - 1].float(), dim=-1),
                   torch.tensor(c, dtype=torch.long))


def _logprob(logps: torch.Tensor, tokens: torch.Tensor) -> float:
    """Sum of log p(completion tokens | prompt)."""
    return logps.gather(-1, tokens[:, None]).sum().item()


def _kl(lp: torch.Tensor, lq: torch.Tensor) -> float:
    """Sum over positions of KL(p || q) of next-token distributions given as log-probabilities."""
    return (lp.exp() * (lp - lq)).sum().item()


@torch.no_grad()
def policy_facts(model, tok, pairs: list[dict], ref=None, batch: int = EVAL_BATCH) -> dict:
    """One pass over the held-out pairs: preference accuracy (chosen log-probability above rejected), mean
    cross-entropy per token of the chosen replies (heldout_loss) and, given a reference model, the mean per-token
    KL(policy || reference) over the chosen replies."""
    model.eval()
    chosen = [_split_ids(tok, p["prompt"], p["chosen"]) for p in pairs]
    rejected = [_split_ids(tok, p["prompt"], p["rejected"]) for p in pairs]
    refs = completion_logps(ref.eval(), chosen, batch) if ref is not None else None
    scores, loss, tokens, kl = [], 0.0, 0, 0.0
    for i, (lp, c) in enumerate(completion_logps(model, chosen + rejected, batch)):
        scores.append(_logprob(lp, c))
        if i < len(chosen):
            loss -= scores[-1]
            tokens += len(c)
            if refs is not None:
                kl += _kl(lp, next(refs)[0])
    wins = sum(scores[i] > scores[len(chosen) + i] for i in range(len(chosen)))
    facts = {"accuracy": wins / max(len(pairs), 1), "loss": loss / max(tokens, 1)}
    if ref is not None:
        facts["kl"] = kl / max(tokens, 1)
    return facts


@torch.no_grad()
def reward_score(model, tok, prompt: str, completion: str) -> float:
    ids = tok(prompt + completion, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return model(ids).logits[0, 0].item()


def reward_accuracy(model, tok, pairs: list[dict]) -> float:
    """Fraction of pairs whose chosen completion the reward model scores above the rejected one."""
    model.eval()
    wins = sum(reward_score(model, tok, p["prompt"], p["chosen"]) > reward_score(model, tok, p["prompt"], p["rejected"])
               for p in pairs)
    return wins / max(len(pairs), 1)


# ---- metrics: TRL's logs become baton events (rank 0 only) ---------------------------------------------------------
def stream_callback():
    from transformers import TrainerCallback

    class StreamEvents(TrainerCallback):
        """perf/step_time_s is timed here (optimizer step begin → end) when TRL's logs lack it (DPO, reward)."""

        started, step_time = 0.0, None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            values = trl_metrics(logs)
            if values and self.step_time is not None and events.STEP_TIME_S not in values:
                values[events.STEP_TIME_S] = self.step_time
            self.step_time = None
            if values:
                events.metric(state.global_step, values)

        def on_step_end(self, args, state, control, **kwargs):
            self.step_time = time.perf_counter() - self.started
            if state.is_world_process_zero:
                events.progress(state.global_step, state.max_steps)

    return StreamEvents()


def non_finite_callback(precision: str):
    """A diverged run stops at the first step whose logged loss or gradient norm is NaN or inf, or whose updated
    weights give non-finite logits (measured: at lr 1e12 GRPO's loss and norm stay finite while the next rollout's
    sampling meets NaN probabilities), before that step's checkpoint is saved (the Trainer logs, then saves), with
    the cause announced: not retried. Every rank stops (the loss is gathered, the norm global, the weights the same).
    Under fp16 an infinite norm is the loss scaler's overflow, a skipped update: only the loss counts there."""
    from transformers import TrainerCallback

    watched = ("loss",) if precision == "fp16" else ("loss", "grad_norm")

    class StopWhenNotFinite(TrainerCallback):
        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if not logs or "loss" not in logs:  # the end-of-training summary, not a step
                return
            bad = [f"{k} {logs[k]}" for k in watched if isinstance(logs.get(k), float) and not math.isfinite(logs[k])]
            if not bad and model is not None and not probe_logits_finite(model):
                bad = ["logits of the updated weights"]
            if bad:
                why = (f"rank {RANK}: non-finite {', '.join(bad)} at step {state.global_step}; lower the lr or check "
                       "the data; not retried")
                events.failure(events.EngineCause.NON_FINITE_LOSS, why)
                raise SystemExit(why)

    return StopWhenNotFinite()


PROBE_TOKENS = 8  # one short forward per step: a tiny cost beside the step's own forwards


@torch.no_grad()
def probe_logits_finite(model) -> bool:
    """Whether the model's logits on a fixed short input are all finite (its weights can be finite and still
    overflow: every one near 1e12 after one Adam step at lr 1e12)."""
    device = next(model.parameters()).device
    ids = torch.arange(PROBE_TOKENS, device=device)[None] % model.config.vocab_size
    was_training = model.training
    model.eval()
    try:
        return bool(torch.isfinite(model(input_ids=ids).logits).all())
    finally:
        model.train(was_training)


def common_args(a: events.RlhfSpec, work: Path) -> dict:
    cpu = not torch.cuda.is_available()
    return dict(output_dir=str(work), max_steps=a.steps, per_device_train_batch_size=a.micro_batch_size,
                gradient_accumulation_steps=a.gradient_accumulation_steps, learning_rate=a.lr,
                lr_scheduler_type=a.lr_schedule, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
                max_grad_norm=a.grad_clip if a.grad_clip > 0 else None, logging_steps=1, report_to=[], seed=a.seed,
                logging_nan_inf_filter=False,  # else a NaN step logs the mean of the earlier losses instead
                data_seed=a.seed, **checkpoint_args(a),
                disable_tqdm=True, dataloader_num_workers=a.dataloader_workers, use_cpu=cpu,
                # TRL defaults to bf16 autocast and activation checkpointing: on CPU that is ~10x slower and inexact
                bf16=a.precision == "bf16", fp16=a.precision == "fp16", gradient_checkpointing=False,
                ddp_backend="gloo" if WORLD_SIZE > 1 and cpu else None,
                ddp_find_unused_parameters=False if WORLD_SIZE > 1 else None)


# ---- checkpoints: TRL's own (model, optimizer, scheduler, RNG, trainer state), marked complete by us ---------------
KIND = resuming.CheckpointKind.TRL
COMPLETE = KIND.marker   # written last, atomically: the checkpoint's files, sizes and sha256


def checkpoint_args(a: events.RlhfSpec) -> dict:
    if a.checkpoint_every <= 0:
        return {"save_strategy": "no"}
    # no save_total_limit: the Trainer would delete the older checkpoints before ours is sealed (with keep 1, a crash
    # there leaves nothing to resume from); checkpoint_callback removes them once the new one is sealed
    return {"save_strategy": "steps", "save_steps": a.checkpoint_every}


def mark_complete(ckpt: Path) -> None:
    sealed.seal(ckpt, COMPLETE, step=KIND.step_of(ckpt))


def is_complete(ckpt: Path) -> bool:
    return sealed.is_sealed(ckpt, COMPLETE)


def checkpoint_callback(keep: int):
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                work = Path(args.output_dir)
                if TRAINING_EPISODES:  # sealed with the checkpoint: a resume from it counts these steps' episodes
                    episodes.save_totals(KIND.folder(work, state.global_step), TRAINING_EPISODES)
                mark_complete(KIND.folder(work, state.global_step))
                resuming.remove_older_than_kept(work, KIND, keep)

    return MarkComplete()


def train_naming_a_full_disk(trainer, work: Path, resume: Path | None) -> None:
    """trainer.train; when a checkpoint save runs out of disk space, the rank removes that partial checkpoint (the
    sealed ones stay) and exits 1 naming the disk and its free space, so the stage fails at once (not retried)."""
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except BaseException:
        saving = KIND.folder(work, trainer.state.global_step)
        if is_complete(saving):  # not inside a save
            raise
        with events.disk_full_exits(saving, RANK):
            raise


# ---- the three recipes -----------------------------------------------------------------------------------------------
def train_dpo(a, tok, train_pairs: list[dict], work: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(a.input), dtype=torch.float32)
    ref = None
    if a.reference_model:  # else TRL keeps a frozen copy of the input as the reference
        ref = AutoModelForCausalLM.from_pretrained(str(a.reference_model), dtype=torch.float32)
    losses = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, a.sft_weight]} if a.sft_weight else {}
    args = DPOConfig(**common_args(a, work), beta=a.beta, max_length=a.max_seq_length,
                     precompute_ref_log_probs=a.reference == "precomputed", **losses)
    return DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(train_pairs),
                      processing_class=tok, callbacks=[stream_callback()])


def train_rm(a, tok, train_pairs: list[dict], work: Path):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    model = AutoModelForSequenceClassification.from_pretrained(str(a.input), num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tok.pad_token_id
    args = RewardConfig(**common_args(a, work), max_length=a.max_seq_length)
    return RewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(train_pairs), processing_class=tok,
                         callbacks=[stream_callback()])


def preference_reward(train_pairs: list[dict], eos: str):
    """A programmatic reward from the preference data: +1 for a completion that starts with a chosen reply of that
    prompt, -1 for one that starts with a rejected reply, 0 otherwise."""
    def norm(text: str) -> str:
        return " ".join(text.replace(eos, " ").split())

    chosen: dict[str, set] = {}
    rejected: dict[str, set] = {}
    for p in train_pairs:
        chosen.setdefault(p["prompt"], set()).add(norm(p["chosen"]))
        rejected.setdefault(p["prompt"], set()).add(norm(p["rejected"]))

    def reward(prompts, completions, **kwargs) -> list[float]:
        out = []
        for prompt, text in zip(prompts, completions):
            t = norm(text)
            if any(t.startswith(c) for c in chosen.get(prompt, ())):
                out.append(1.0)
            elif any(t.startswith(r) for r in rejected.get(prompt, ())):
                out.append(-1.0)
            else:
                out.append(0.0)
        return out

    reward.__name__ = "preference_match"
    return reward


def train_grpo(a, tok, train_pairs: list[dict], work: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(a.input), dtype=torch.float32)
    prompts = Dataset.from_list([{"prompt": p["prompt"]} for p in train_pairs])
    args = GRPOConfig(**common_args(a, work), beta=a.beta, num_generations=a.num_generations,
                      max_completion_length=a.max_completion_length, temperature=a.temperature, use_vllm=False,
                      log_completions=False)
    return GRPOTrainer(model=model, reward_funcs=[preference_reward(train_pairs, tok.eos_token)], args=args,
                       train_dataset=prompts, processing_class=tok, callbacks=[stream_callback()])


# ---- GRPO with verifiable rewards on prompts with answers (rlhf.rewards, data.prompts) -------------------------------
def format_prompts(tok, rows: list[dict], split: str) -> list[dict]:
    """Canonical prompts rows → the rendered prompt (as TRL tokenizes it), the text rewards see, the row's other
    columns, and where the row lies (prompts/<split>.jsonl:<line>, named when a reward fails on it)."""
    return [{"prompt": chat.for_special_tokens(tok, chat.prompt_text(tok, r["prompt"])),
             "text": rw.last_user_text(r["prompt"]), "fields": rw.row_fields(r), "messages": r["prompt"],
             "where": f"prompts/{split}.jsonl:{i}"} for i, r in enumerate(rows, start=1)]


def trl_reward(reward: rw.Reward, rows: list[dict]):
    """One reward as a TRL reward function: TRL passes the dataset's columns, of which row_index finds the row."""
    def score(prompts, completions, row_index, final_reply=None, **kwargs) -> list[float]:
        replies = completions if final_reply is None else final_reply  # an episode: its model's last turn
        return reward.score_many([(rows[i]["text"], text, rows[i]["fields"], rows[i]["where"])
                                  for i, text in zip(row_index, replies)])

    score.__name__ = reward.name
    return score


def train_grpo_rewards(a, tok, rows: list[dict], work: Path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(a.input), dtype=torch.float32)
    rewards = [rw.build(spec.model_dump(), i) for i, spec in enumerate(a.rewards)]
    funcs, weights = [trl_reward(r, rows) for r in rewards], [r.weight for r in rewards]
    if a.environment is not None:
        funcs, weights = funcs + [environment_reward], weights + [1.0]
    prompts = Dataset.from_list([{"prompt": r["prompt"], "row_index": i} for i, r in enumerate(rows)])
    args = GRPOConfig(**common_args(a, work), beta=a.beta, num_generations=a.num_generations,
                      max_completion_length=a.max_completion_length, temperature=a.temperature, use_vllm=False,
                      log_completions=False, epsilon=a.clip_epsilon, epsilon_high=a.clip_epsilon_high,
                      loss_type=a.loss_type, scale_rewards=a.scale_rewards, reward_weights=weights)
    episodic = {}
    if a.tools or a.environment:  # multi-turn episodes, through TRL's rollout_func (tasks/rlhf/episodes.py)
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        by_prompt = {r["prompt"]: (r["text"], r["fields"], r["messages"]) for r in rows}
        episodic["rollout_func"] = episodes.rollout_func(episode_runner(a, tok), TRAINING_EPISODES, by_prompt)
    return timed_rollouts(GRPOTrainer)(model=model, reward_funcs=funcs, args=args, train_dataset=prompts,
                                       processing_class=tok, callbacks=[stream_callback()], **episodic)


def environment_reward(prompts, completions, environment_reward, **kwargs) -> list[float]:
    """rlhf.environment's reward of each episode (the sum of its steps' rewards), weight 1."""
    return list(environment_reward)


TRAINING_EPISODES: dict = {}  # the run's training episodes (episodes.summary), filled as the rollouts run


def episode_runner(a, tok) -> episodes.EpisodeRunner:
    code = EnvironmentCode(**a.environment.model_dump()) if a.environment is not None else None
    return episodes.EpisodeRunner(tok, episodes.Limits(tuple(a.tools), a.max_turns, a.max_completion_length,
                                                       a.tool_timeout_s, code))


def timed_rollouts(trainer_cls):
    """GRPO's trainer that also logs where a step's time goes: the rollouts (generation, TRL's `_generate`) against
    the rest (rewards, log-probs, backward, optimizer), and the rollouts' completion tokens per second."""

    class TimedRollouts(trainer_cls):
        def _generate(self, prompts: list):
            started = time.perf_counter()
            out = super()._generate(prompts)
            seconds = time.perf_counter() - started
            tokens = sum(len(ids) for ids in out[1])  # completion ids, one list per rollout
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["rollout_time"].append(seconds)
            metrics["rollout_tokens_per_s"].append(tokens / max(seconds, 1e-9))
            return out

        def log(self, logs: dict, start_time: float | None = None) -> None:
            metrics = self._metrics["train"]
            if metrics.get("rollout_time") and metrics.get("step_time"):
                metrics["rollout_share"] = [sum(metrics["rollout_time"]) / max(sum(metrics["step_time"]), 1e-9)]
            super().log(logs, start_time)

    return TimedRollouts


@torch.no_grad()
def greedy_replies(model, tok, prompts: list[str], max_new_tokens: int, batch: int = EVAL_BATCH) -> list[str]:
    """Greedy completions of rendered prompts, tokenized as TRL tokenizes them (special tokens added), decoded
    without special tokens as TRL decodes its samples."""
    model.eval()
    side, tok.padding_side = tok.padding_side, "left"
    out = []
    try:
        for start in range(0, len(prompts), batch):
            enc = tok(prompts[start:start + batch], return_tensors="pt", padding=True)
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            out += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        tok.padding_side = side
    return out


def reward_facts(model, tok, rows: list[dict], rewards: list[rw.Reward], a, label: str) -> dict:
    """Mean weighted reward of greedy replies to the held-out prompts, and the fraction solved (every reward full);
    with rlhf.tools, of greedy episodes (their last model turn), and the episodes' ends and tool calls."""
    prompts = [r["prompt"] for r in rows]
    facts = {}
    environment = [0.0] * len(rows)
    if a.tools or a.environment:
        played = episode_runner(a, tok).run(model.eval(), prompts, {"do_sample": False},
                                            [(r["text"], r["fields"], r["messages"]) for r in rows])
        replies, environment = [e.reply for e in played], [e.environment_reward for e in played]
        facts["episodes"] = episodes.summary(played)
    else:
        replies = greedy_replies(model, tok, prompts, a.max_completion_length)
    items = [(r["text"], reply, r["fields"], r["where"]) for r, reply in zip(rows, replies)]
    by_reward = [w.score_many(items) for w in rewards]
    total, solved = 0.0, 0
    for scores, env_reward in zip(zip(*by_reward), environment):
        total += sum(w.weight * x for w, x in zip(rewards, scores)) + env_reward
        solved += rw.solved(scores)
    if replies:
        print(f"held-out {label}: {rows[0]['text']!r} → {replies[0]!r}", flush=True)
    n = max(len(rows), 1)
    return {"heldout_reward": total / n, "heldout_solved": solved / n, **facts}


def rewards_before(a, tok, held: list[dict]) -> dict:
    rewards = [rw.build(spec.model_dump(), i) for i, spec in enumerate(a.rewards)]
    return reward_facts(load_eval_model(a.input, a.algorithm), tok, held, rewards, a, "before")


def evaluate_rewards(a, tok, held: list[dict], before: dict) -> dict:
    """heldout_reward and the fraction solved, of the input (measured before training) and of the saved output."""
    rewards = [rw.build(spec.model_dump(), i) for i, spec in enumerate(a.rewards)]
    after = reward_facts(load_eval_model(a.output, a.algorithm), tok, held, rewards, a, "after")
    facts = {"metric": "heldout_reward", "before": before["heldout_reward"], "after": after["heldout_reward"],
             "solved_before": before["heldout_solved"], "solved_after": after["heldout_solved"],
             "heldout_prompts": len(held)}
    if a.tools or a.environment:
        facts["episodes"] = {"train": TRAINING_EPISODES or None, "heldout_before": before["episodes"],
                             "heldout_after": after["episodes"]}
    return _printed(facts)


TRAINERS = {"dpo": train_dpo, "rm": train_rm, "grpo": train_grpo}


def load_eval_model(path: Path, algorithm: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if algorithm == "rm":
        return AutoModelForSequenceClassification.from_pretrained(str(path), num_labels=1, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def write_manifest(a, out: Path, metrics: dict) -> None:
    src = mf.read(a.input) or {}
    role = "reward-model" if a.algorithm == "rm" else "policy"
    m = mf.build(
        out, format=Format.HF_SAFETENSORS, stage=a.stage,
        engine={"name": "trl", **mf.engine_versions("trl", "transformers", "torch", "accelerate")},
        architecture=dict(src.get("architecture") or {}), parameter_count=hf.parameter_count(out),
        dtype=hf.dominant_dtype(out), parent=mf.parent_ref(a.input),
        extra={"backend": "trl", "algorithm": a.algorithm, "role": role, "steps": a.steps, "beta": a.beta,
               "learning_rate": a.lr, "sft_weight": a.sft_weight if a.algorithm == "dpo" else None,
               "reference": str(a.reference_model) if a.reference_model else a.reference, **metrics},
        tokenizer_dir=out)
    mf.write(out, m)


def metric_name(algorithm: str) -> str:
    return "heldout_reward_accuracy" if algorithm == "rm" else "heldout_pref_accuracy"


def before_facts(a, tok, held_pairs: list[dict]) -> dict:
    """The input model's held-out preference accuracy and (policies) its loss on the chosen replies: one load, one
    pass."""
    model = load_eval_model(a.input, a.algorithm)
    if a.algorithm == "rm":
        return {metric_name(a.algorithm): reward_accuracy(model, tok, held_pairs)}
    facts = policy_facts(model, tok, held_pairs)
    return {metric_name(a.algorithm): facts["accuracy"], "heldout_loss": facts["loss"]}


def evaluate(a, tok, held_pairs: list[dict], before: dict | None = None) -> dict:
    """Held-out accuracy of the input (unless given) and of the saved output; KL to the reference for policies."""
    metric = metric_name(a.algorithm)
    if before is None:
        before = before_facts(a, tok, held_pairs)
    saved = load_eval_model(a.output, a.algorithm)
    if a.algorithm == "rm":
        return _printed({"metric": metric, "before": before[metric], "after": reward_accuracy(saved, tok, held_pairs),
                         "heldout_pairs": len(held_pairs)})
    after = policy_facts(saved, tok, held_pairs, ref=load_eval_model(a.reference_model or a.input, a.algorithm))
    return _printed({"metric": metric, "before": before[metric], "after": after["accuracy"],
                     "heldout_pairs": len(held_pairs), "heldout_kl_to_reference": after["kl"],
                     "heldout_loss_before": before["heldout_loss"], "heldout_loss_after": after["loss"]})


def _printed(facts: dict) -> dict:
    held = (f"{facts['heldout_prompts']} held-out prompts" if "heldout_prompts" in facts else
            f"{facts['heldout_pairs']} held-out pairs")
    print(f"{facts['metric']}: {facts['before']:.4f} before, {facts['after']:.4f} after ({held})", flush=True)
    return facts


if __name__ == "__main__":
    with events.causes_announced():
        main()
