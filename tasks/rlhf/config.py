from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from tasks import paths
from tasks.gates import GateConfig
from tasks.stage import StrictModel
from tasks.vocabulary import Precision, TrainingConfig


class NemoRlConfig(StrictModel):
    """How the nemo_rl backend runs. Where NeMo-RL lives (checkout path, container image, Slurm) is the runtime
    `runtimes.nemo_rl` (kind venv = a checkout at `path`; container = `image`; slurm = `ray.sub` in `path`)."""

    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (nodes: runtimes.nemo_rl.nodes)")
    precision: Precision = Field("bf16", description="NeMo-RL's training precision")
    micro_batch_size: int = Field(1, ge=1, description="NeMo-RL's own micro batch per GPU")
    slurm_account: str | None = Field(None, description="slurm: the job's account")
    slurm_partition: str | None = Field(None, description="slurm: the job's partition")
    slurm_time: str = Field("4:0:0", description="slurm: the job's time limit")
    overrides: list[str] = Field(default_factory=list, description="extra NeMo-RL key=value overrides, passed last")


class RewardConfig(StrictModel):
    """One verifiable reward of algorithm grpo on data.prompts (tasks/rlhf/rewards.py). The rewards of a list are
    summed, each times its weight."""

    kind: Literal["exact_match", "regex", "json_schema", "length", "code_tests", "function"] = Field(
        ..., description="exact_match: the final answer equals the row's; regex: the pattern is found; json_schema: "
                         "the reply is JSON the schema accepts; length: its characters within bounds; code_tests: the "
                         "fraction of the row's tests its code passes, in a sandbox; function: yours")
    weight: float = Field(1.0, description="multiplies this reward in the sum")
    extract: Literal["last_number", "boxed", "regex", "full"] = Field(
        "last_number", description="exact_match: the final answer is the last number, the last \\boxed{}, group 1 of "
                                   "the pattern's last match, or the full reply (stripped)")
    answer_field: str = Field("answer", description="exact_match: the row's column holding the reference answer")
    pattern: str | None = Field(None, description="regex: the pattern to find; exact_match extract regex: group 1 "
                                                  "is the answer")
    json_schema: dict | None = Field(None, description="json_schema: the JSON Schema (inline)")
    min_chars: int | None = Field(None, ge=0, description="length: fewest characters")
    max_chars: int | None = Field(None, ge=0, description="length: most characters")
    code: Literal["last_block", "full"] = Field(
        "last_block", description="code_tests: run the reply's last ```python (or untagged) block, or the whole reply")
    tests_field: str = Field("tests", description="code_tests: the row's column holding its tests: a list of Python "
                                                  "statements (asserts) and/or {input, output} objects (stdin → stdout)")
    timeout_s: float = Field(5.0, gt=0, le=300, description="code_tests: wall-clock seconds for one completion's run "
                                                           "of all its tests (then its process group is killed)")
    memory_mb: int = Field(512, ge=64, description="code_tests: the sandboxed process's address space (RLIMIT_AS)")
    isolation: Literal["required", "limits_only"] = Field(
        "required", description="code_tests: required refuses before launch where this machine cannot isolate the code "
                                "(no network namespace, Landlock or seccomp); limits_only runs it with the resource "
                                "limits and whatever isolation works, and says what is missing")
    function: str | None = Field(None, description="function: 'path/to/rewards.py:fn', called fn(prompt, completion, "
                                                   "**row) -> float in the worker",
                                 json_schema_extra=paths.contents(paths.Contents.FUNCTION))


class RlhfConfig(TrainingConfig):
    """Preference optimisation of the input HF checkpoint on the data stage's preference pairs. nemo_rl: the global
    batch is micro_batch_size × gradient_accumulation_steps (its own micro batch is nemo_rl.micro_batch_size)."""

    renamed: ClassVar[dict[str, str]] = {
        "batch_size": "micro_batch_size", "grad_accum": "gradient_accumulation_steps", "learning_rate": "lr",
        "max_length": "max_seq_length", "nproc": "nproc_per_node", "processes": "nproc_per_node"}

    backend: Literal["auto", "trl", "nemo_rl"] = Field(
        "auto", description="auto: nemo_rl when a GPU and a NeMo-RL runtime are present (dpo, rm; grpo only when "
                            "set to nemo_rl), else trl")
    algorithm: Literal["dpo", "rm", "grpo"] = Field(
        "dpo", description="dpo: DPO plus an SFT loss on the chosen replies; rm: a reward model saved beside, the "
                           "policy unchanged; grpo: rlhf.rewards on data.prompts, else a reward from the preference "
                           "data")
    micro_batch_size: int = Field(32, ge=1, description="pairs (dpo, rm) or completions (grpo) per step and process")
    nproc_per_node: int = Field(1, ge=1, le=8, description="trl: CPU processes (torchrun, gloo) when > 1")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="learning-rate schedule "
                                                                                          "after the warm-up")
    beta: float = Field(0.1, description="dpo: preference temperature (> 0); grpo: KL penalty to the reference (>= 0; "
                                         "0 as in DAPO and Dr. GRPO: no reference model)")
    sft_weight: float = Field(
        1.0, ge=0, description="dpo: weight of an SFT loss on the chosen replies added to the DPO loss (RPO; NeMo-RL "
                               "dpo.sft_loss_weight); keeps a model new to the chat format generating replies")
    reference: Literal["copy", "precomputed"] = Field(
        "copy", description="dpo reference: a frozen copy of the input in memory, or its log-probs precomputed once")
    reference_model: str | None = Field(None, description="another HF checkpoint folder as the dpo reference",
                                        json_schema_extra=paths.contents(paths.Contents.CHECKPOINT))
    num_generations: int = Field(4, ge=2, description="grpo: completions sampled per prompt")
    max_completion_length: int = Field(16, ge=1, description="grpo: new tokens per completion")
    temperature: float = Field(1.0, gt=0, le=2, description="grpo: sampling temperature of the rollouts (the trainer's "
                                                            "log-probs are taken at the same temperature); the "
                                                            "held-out gate stays greedy")
    rollout_engine: Literal["hf", "vllm"] = Field(
        "hf", description="grpo (trl): who samples the rollouts: hf (the trainer's model.generate) or vllm (a vLLM "
                          "server from the vllm runtime, its weights reloaded from the policy after each step; TRL "
                          "logs the per-token log-prob difference and corrects for it by importance sampling)")
    rewards: list[RewardConfig] = Field(default_factory=list, description="grpo: verifiable rewards on data.prompts, "
                                                                          "summed with their weights")
    tools: list[Literal["calculator", "python"]] = Field(
        default_factory=list, description="grpo with rewards: built-in tools the policy may call in multi-turn "
                                          "episodes (ChatML tool_call tags around JSON): calculator (arithmetic), "
                                          "python (code run in the code_tests sandbox; what it prints is the result)")
    max_turns: int = Field(4, ge=1, le=32, description="grpo with tools: model turns per episode (each tool call "
                                                       "starts another)")
    tool_timeout_s: float = Field(5.0, gt=0, le=300, description="grpo with tools: wall-clock seconds of one tool "
                                                                 "call (then it is killed and the episode ends)")
    environment: str | None = Field(
        None, description="grpo with rewards: 'path/to/env.py:ClassName', your environment, one instance per episode in "
                          "a child process of its own: reset(prompt, **row) at the start, step(reply) -> (next user "
                          "message or None, reward, done) after each model answer; its rewards add to rlhf.rewards",
        json_schema_extra=paths.contents(paths.Contents.FUNCTION))
    clip_epsilon: float = Field(0.2, gt=0, description="grpo: the policy ratio is clipped to 1 ± clip_epsilon (TRL "
                                                      "epsilon)")
    clip_epsilon_high: float | None = Field(None, gt=0, description="grpo: upper clip (DAPO's clip-higher, e.g. 0.28; "
                                                                    "TRL epsilon_high); unset: clip_epsilon")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field("dapo", description="grpo: how token losses are "
                                                                                      "averaged (TRL loss_type)")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="grpo: advantages divided by the reward std of the group, of the batch, or not (Dr. GRPO)")
    dataloader_workers: int = Field(0, ge=0, description="trl: data-loader worker processes per rank (each copies "
                                                      "the dataset; above ~8 CPU RAM blows up)")
    gate: GateConfig = GateConfig()
    overlong: Literal["drop", "truncate"] = Field("drop", description="pairs longer than max_seq_length")
    packing: bool = Field(False, description="pack examples into max_seq_length windows (no attention across "
                                             "examples; position ids restart per example): each micro batch row is "
                                             "then a window, so steps cover more examples and no padding is trained. "
                                             "Only nemo_rl grpo packs (NeMo-RL's sequence packing); refused where "
                                             "the engine cannot (TRL 1.16: dpo, rm, grpo; NeMo-RL: dpo, rm)")
    nemo_rl: NemoRlConfig = NemoRlConfig()
