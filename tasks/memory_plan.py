"""Memory and layout planning: which parallel layout fits a model on given hardware, and how much memory each rank
needs.

Pure arithmetic (no torch import), used by `baton plan`, `baton doctor` and the run summary. Sources of the formulas:

- Model states (ZeRO paper, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", §3.1 and Fig. 1): mixed-precision Adam keeps 2Ψ bytes of fp16/bf16 weights, 2Ψ of gradients and KΨ = 12Ψ of
  optimizer state (fp32 master weights, momentum, variance). ZeRO-1 divides the 12Ψ by the data-parallel size N, ZeRO-2
  also the gradients, ZeRO-3 also the weights. DeepSpeed docs ("Memory Requirements",
  estimate_zero2/3_model_states_mem_needs) use the same numbers and count model states only — one reason its
  estimates run 50–75% low in practice.
- Megatron-Core keeps fp32 main gradients: bf16 weights 2 + fp32 grads 4 + optimizer 12 = 18 bytes/param; the
  distributed optimizer shards the 12 over DP: 6 + 12/d (Megatron-LM docs, "Distributed Optimizer", table of bytes per
  parameter; fp32 training: 16 → 8 + 8/d).
- Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4, eqs. 1–6):
  per layer s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations; tensor parallel without sequence parallel
  s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence parallel s·b·h/t·(34 + 5·a·s/h); selective recompute drops the 5·a·s/h
  attention-score term (as does flash attention); full recompute keeps only each layer's input, 2·s·b·h (/t with SP).
  With 1F1B pipelining the first stage holds min(p, m) micro-batches of L/p layers (§4.2.3), i.e. up to L layers' worth;
  the output layer and cross-entropy add 4·s·b·v/t. We generalise the 34 to Llama blocks: attention 7 + 4·g/a (GQA
  shrinks K and V), two norms 4, SwiGLU MLP 3 + 6·f/h (the paper's GELU MLP, 3 + 4·f/h, is 19 at f = 4h).
- Mixtures of experts (Megatron-Core's expert parallel, Megatron-LM docs "Mixture of Experts"): EP ranks are data-
  parallel ranks; each holds 1/(TP·EP) of every layer's routed experts (expert tensor parallel = TP) and the router
  whole; the distributed optimizer shards expert states over the expert data-parallel group, DP/EP.
- Engine buffers: CUDA context, NCCL and allocator reserve (a fixed allowance), plus DeepSpeed's reduce/all-gather
  buckets (elements × 2 bytes each) — DeepSpeed docs, "ZeRO optimizations: reduce_bucket_size,
  allgather_bucket_size"; ZeRO-3 also gathers whole parameters for each forward/backward, up to
  stage3_max_live_parameters (1e9 by default): we count two copies of the live parameters (the all-gather's flat
  buffer and the unflattened weights).
- CPU: everything fp32, no flash attention, plus the runtime the engine imports (torch, Megatron or DeepSpeed), fitted
  against peak RSS measured on real runs (benchmarks/memory_calibration.py; table in the README).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from tasks.memory_model import MemoryModel, Parallelism

GiB = 2**30
# What the size guide says (field practice, issue 15): by parameter count, the strategy to start from.
SIZE_GUIDE = [
    (10e9, "< 10B: data parallel with sharded optimizer states (DeepSpeed ZeRO-2, or Megatron DP + distributed "
           "optimizer)"),
    (30e9, "10-30B: ZeRO-3, or Megatron tensor parallel within a node"),
    (100e9, "30-100B: Megatron 3D parallelism (TP within a node × PP across nodes × DP)"),
    (math.inf, "100B+: Megatron / NeMo 3D parallelism (plus context or expert parallel)"),
]
GPU_CONTEXT_BYTES = int(1.5 * GiB)    # CUDA context + NCCL communicators + allocator reserve, per GPU (allowance)
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000   # DeepSpeed's stage3_max_live_parameters default (docs, ZeRO config)
DOCTOR_BUFFER = 0.5                   # doctor: estimates run 50-75% low, so want 1.5× the estimate free
DEFAULT_HEADROOM = 0.2                # plan: pick layouts whose estimate leaves 20% of the device free

# CPU constants per engine, fitted by least squares on measured peak RSS of real runs
# (benchmarks/memory_calibration.py; the table and residuals are in the README):
#   base_mb: the runtime before the model (interpreter, torch, the engine's imports, data loading);
#   activation_factor: unfused fp32 CPU kernels keep more intermediates than the paper's fused GPU count;
#   staging_bytes_per_param: what grows with the model beyond its training states — the checkpoint save's copies, the
#   reload check's fresh model, the input weights read from disk.
CPU_FIT = {
    "megatron": {"base_mb": 415.4, "activation_factor": 1.108, "staging_bytes_per_param": 24.5},
    "deepspeed": {"base_mb": 651.5, "activation_factor": 1.0, "staging_bytes_per_param": 7.73},
    "trl": {"base_mb": 584.8, "activation_factor": 0.616, "staging_bytes_per_param": 0.60},  # DPO, 2 sizes × 3 micro
}


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder; with `experts`, every layer's MLP is a mixture of experts: a router (hidden × experts),
    `experts` SwiGLU experts of width `expert_ffn` of which each token uses `top_k`, and optionally a shared expert of
    width `shared_ffn` that every token uses (`ffn` is then unused)."""
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0

    def routed_expert_params(self) -> int:
        """One layer's routed experts: what expert parallel splits (the router and a shared expert stay whole)."""
        return self.experts * 3 * self.hidden * self.expert_ffn

    def mlp_params(self, active: bool = False) -> int:
        """One layer's MLP: every expert's weights, or (active) those a token goes through."""
        if not self.experts:
            return 3 * self.hidden * self.ffn
        routed = (self.top_k if active else self.experts) * 3 * self.hidden * self.expert_ffn
        return self.hidden * self.experts + routed + 3 * self.hidden * self.shared_ffn

    def layer_params(self, active: bool = False) -> int:
        d = self.hidden // self.heads
        attention = self.hidden * (self.heads + 2 * self.groups) * d + self.heads * d * self.hidden
        return attention + self.mlp_params(active) + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self, active: bool = False) -> int:
        """Every parameter (what memory holds), or (active) those one token's forward pass uses."""
        out = 0 if self.tied else self.embedding_params()
        return self.layers * self.layer_params(active) + self.embedding_params() + out + self.hidden

    def active_ffn(self) -> int:
        """The MLP width one token's activations span: ffn, or its top_k experts' and the shared expert's."""
        return self.top_k * self.expert_ffn + self.shared_ffn if self.experts else self.ffn


# Llama 3 / 3.1 / 3.2 shapes; a bare parameter count picks the nearest and adjusts the depth.
LLAMA_SHAPES = [
    Shape(16, 2048, 32, 8, 8192, 128256, tied=True),     # 1B
    Shape(28, 3072, 24, 8, 8192, 128256, tied=True),     # 3B
    Shape(32, 4096, 32, 8, 14336, 128256),               # 8B
    Shape(80, 8192, 64, 8, 28672, 128256),               # 70B
    Shape(126, 16384, 128, 8, 53248, 128256),            # 405B
]


def shape_for_params(n: float) -> Shape:
    """A Llama-like shape with about n parameters: the nearest Llama width, depth adjusted to the count."""
    base = min(LLAMA_SHAPES, key=lambda s: abs(math.log(s.params() / n)))
    if abs(math.log(base.params() / n)) < 0.1:  # "70e9" means Llama-70B itself (70.6B), not 79 of its layers
        return base
    fixed = base.params() - base.layers * base.layer_params()
    layers = max(1, round((n - fixed) / base.layer_params()))
    return replace(base, layers=layers)


def strategy_for(params: float) -> str:
    return next(text for limit, text in SIZE_GUIDE if params < limit)


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int                 # ranks per node (CPU processes on a CPU machine)
    memory_gb: float                   # per device (GPU memory, or the machine's RAM shared by its ranks on CPU)
    device: str = "cuda"               # cuda | cpu

    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def per_rank_bytes(self) -> float:
        per = self.memory_gb * GiB
        return per / self.gpus_per_node if self.device == "cpu" else per


def memory_model(stage: str) -> MemoryModel:
    from tasks.registry import STAGES  # (the stages declare their models with this module's types)

    return STAGES[stage].memory


@dataclass(frozen=True)
class Layout:
    stage: str                          # a training stage: its memory_model says how its engine holds memory
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1                         # Megatron's expert parallel: the DP ranks each MoE layer's experts are split over
    micro_batch: int = 1
    global_batch: int = 1
    zero_stage: int = 0                 # DeepSpeed stages; 0 for Megatron
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    recompute: str = "none"             # none | selective | full
    offload_optimizer: bool = False
    offload_params: bool = False
    etp: int | None = None              # Megatron's expert tensor parallel (None: tp, Megatron's default)

    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def describe(self) -> str:
        if memory_model(self.stage).parallelism == Parallelism.MEGATRON:
            extra = [f"recompute {self.recompute}"]
            extra += ["distributed optimizer"] if self.distributed_optimizer else []
            extra += ["sequence parallel"] if self.sequence_parallel else []
            experts = f" (EP{self.ep})" if self.ep > 1 else ""
            experts = f" (EP{self.ep}, ETP{self.etp})" if self.ep > 1 and self.etp not in (None, self.tp) else experts
            return f"TP{self.tp} × PP{self.pp} × DP{self.dp}{experts}, " + ", ".join(extra)
        off = [n for n, on in (("optimizer", self.offload_optimizer), ("params", self.offload_params)) if on]
        return (f"ZeRO-{self.zero_stage} × DP{self.dp}, recompute {self.recompute}"
                + (f", offload {'+'.join(off)} to CPU" if off else ""))


@dataclass
class Breakdown:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    activations_without_recompute: float
    buffers: float
    extra: dict = field(default_factory=dict)

    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def as_gib(self) -> dict:
        d = {k: round(v / GiB, 3) for k, v in asdict(self).items() if isinstance(v, (int, float))}
        return {**d, "total": round(self.total() / GiB, 3)}


# ---- model states ----------------------------------------------------------------------------------------------------
FP32_BYTES = 4
BYTES_OF_PRECISION = {"fp32": FP32_BYTES, "bf16": 2, "fp16": 2}  # a value of each training precision (vocabulary.py)


def state_bytes_per_param(layout: Layout, precision: str, expert: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter on one rank, after the layout's sharding. Megatron's
    distributed optimizer shards a routed expert's state over the ranks holding the same experts, DP / EP (Megatron-Core
    keeps expert-parallel parameters in their own buffers, reduced over the expert data-parallel group: TP × DP /
    (ETP × EP) ranks, DP / EP at Megatron's default ETP = TP)."""
    w = BYTES_OF_PRECISION[precision]
    o = 2 * FP32_BYTES + (FP32_BYTES if w < FP32_BYTES else 0)  # Adam's two moments, plus an fp32 master copy if 16-bit
    if memory_model(layout.stage).parallelism == Parallelism.MEGATRON:  # fp32 main grads; sharded optimizer only
        shards = layout.tp * layout.dp // (layout.expert_tp() * layout.ep) if expert else layout.dp
        return w, FP32_BYTES, o / shards if layout.distributed_optimizer else o
    g = w                                            # ZeRO paper: 2Ψ + 2Ψ + KΨ
    n = layout.dp
    o = 0 if layout.offload_optimizer else (o / n if layout.zero_stage >= 1 else o)
    g = g / n if layout.zero_stage >= 2 else g
    w = 0 if layout.offload_params else (w / n if layout.zero_stage >= 3 else w)
    return w, g, o


def params_per_rank(shape: Shape, layout: Layout) -> float:
    """Parameters held by the busiest rank: Megatron splits layers over PP and matrices over TP, and a mixture's routed
    experts also over EP (the router is whole on every rank; the first stage also holds the embedding, the last the
    output layer); DeepSpeed ranks hold the whole model (ZeRO shards it later)."""
    if memory_model(layout.stage).parallelism != Parallelism.MEGATRON:
        return float(shape.params())
    per_layer = (shape.layer_params() - shape.routed_expert_params()) / layout.tp
    emb = shape.embedding_params() / layout.tp
    body = shape.layers / layout.pp * per_layer + expert_params_per_rank(shape, layout)
    if layout.pp == 1:
        return body + emb * (1 if shape.tied else 2) + shape.hidden
    return body + emb + shape.hidden  # the last stage: output layer (a tied copy too) and the final norm


def expert_params_per_rank(shape: Shape, layout: Layout) -> float:
    """The routed experts' parameters among params_per_rank, split over expert tensor parallel (TP's by default)."""
    if memory_model(layout.stage).parallelism != Parallelism.MEGATRON:
        return float(shape.layers * shape.routed_expert_params())
    return shape.layers / layout.pp * shape.routed_expert_params() / (layout.expert_tp() * layout.ep)


# ---- activations -----------------------------------------------------------------------------------------------------
def layer_activation_coefficient(shape: Shape) -> float:
    """The paper's 34 for a Llama block: attention 7 + 4·g/a, two norms 4, SwiGLU MLP 3 + 6·f/h. A mixture of
    experts: f is the width a token goes through (top_k experts and the shared one), plus its k routed copies (2·k).
    Expert parallel leaves this unchanged under balanced routing: a rank's E/EP experts receive, from the EP ranks'
    EP·s·b tokens, EP·s·b·k·(1/EP) = s·b·k token copies, as at EP 1."""
    routed_copies = 2 * shape.top_k if shape.experts else 0
    return 7 + 4 * shape.groups / shape.heads + 4 + 3 + 6 * shape.active_ffn() / shape.hidden + routed_copies


def layer_activation_bytes(shape: Shape, seq: int, layout: Layout, flash: bool) -> float:
    """One layer, one micro-batch, 16-bit activations (Korthikanti et al. eqs. 2-6)."""
    sbh = seq * layout.micro_batch * shape.hidden
    t, sp = layout.tp, layout.sequence_parallel
    if layout.recompute == "full":
        return 2 * sbh / (t if sp else 1)
    c = layer_activation_coefficient(shape)
    scores = 0.0 if (flash or layout.recompute == "selective") else 5 * shape.heads * seq / shape.hidden
    if sp:
        return sbh / t * (c + scores)
    return sbh * (10 + (c - 10) / t + scores / t)


def activation_bytes(shape: Shape, seq: int, layout: Layout, flash: bool, bytes_per_value: int = 2) -> float:
    """The busiest pipeline stage: the first holds min(p, m) micro-batches of L/p layers under 1F1B, the last one
    micro-batch plus the fp32 logits (4·s·b·v/t). Full recompute also needs one layer's working set at a time."""
    per_layer = layer_activation_bytes(shape, seq, layout, flash)
    if layout.recompute == "full":
        per_layer_work = layer_activation_bytes(shape, seq, replace(layout, recompute="none"), flash)
    else:
        per_layer_work = 0.0
    microbatches = max(1, layout.global_batch // max(1, layout.micro_batch * layout.dp))
    in_flight = min(layout.pp, microbatches)
    logits = 4 * seq * layout.micro_batch * shape.vocab / layout.tp
    layers_per_stage = shape.layers / layout.pp
    first = in_flight * layers_per_stage * per_layer + per_layer_work + (logits if layout.pp == 1 else 0)
    last = layers_per_stage * per_layer + per_layer_work + logits
    return max(first, last) * bytes_per_value / 2


# ---- per-rank breakdown ----------------------------------------------------------------------------------------------
def engine_of(layout: Layout) -> str:
    return memory_model(layout.stage).engine


def breakdown(shape: Shape, layout: Layout, seq: int, precision: str, device: str,
              bucket_elements: int = 50_000_000) -> Breakdown:
    """Bytes one rank needs: model states, activations (and what they would be without recompute), buffers."""
    on_cpu = device == "cpu"
    if on_cpu:
        precision = "fp32"
    n = params_per_rank(shape, layout)
    w, g, o = state_bytes_per_param(layout, precision)
    experts = expert_params_per_rank(shape, layout)
    optimizer = (n - experts) * o + experts * state_bytes_per_param(layout, precision, expert=True)[2]
    weights = n * w
    if memory_model(layout.stage).reference_copy:  # DPO's frozen reference copy (16-bit on GPU), sharded like the weights under ZeRO-3
        ref = n * (4 if on_cpu else 2) / (layout.dp if layout.zero_stage >= 3 else 1)
        weights += ref
    act_bytes = 4 if on_cpu else 2
    flash = not on_cpu
    fit = CPU_FIT[engine_of(layout)]
    acts = activation_bytes(shape, seq, layout, flash, act_bytes) * (fit["activation_factor"] if on_cpu else 1)
    no_rc = activation_bytes(shape, seq, replace(layout, recompute="none"), flash, act_bytes)
    if on_cpu:
        buffers = fit["base_mb"] * 2**20 + fit["staging_bytes_per_param"] * n
    else:
        megatron = memory_model(layout.stage).parallelism == Parallelism.MEGATRON
        buckets = 0 if megatron else 2 * bucket_elements * 2
        buffers = GPU_CONTEXT_BYTES + buckets
    if layout.zero_stage == 3:  # gathered working set: the all-gather's flat buffer and the unflattened parameters
        buffers += 2 * min(n, ZERO3_MAX_LIVE_PARAMETERS) * BYTES_OF_PRECISION[precision]  # (fp32 on CPU: above)
    offloaded = (shape.params() * 12 / layout.dp if layout.offload_optimizer else 0)
    return Breakdown(weights, n * g, optimizer, acts, no_rc, buffers,
                     extra={"params_per_rank": int(n), "cpu_offload_bytes_per_rank": offloaded})


# ---- search ----------------------------------------------------------------------------------------------------------
RECOMPUTE = ("none", "selective", "full")


@dataclass
class Plan:
    shape: Shape
    hardware: Hardware
    stage: str
    seq: int
    precision: str
    headroom: float
    strategy: str
    layout: Layout | None = None
    memory: Breakdown | None = None
    reason: str = ""                    # why nothing fits (empty when a layout was found)
    rejected: list[str] = field(default_factory=list)   # layouts refused by divisibility, one line each
    considered: int = 0

    def budget(self) -> float:
        return self.hardware.per_rank_bytes() / (1 + self.headroom)


def _powers_of_two(limit: int) -> list[int]:
    out, v = [], 1
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def megatron_parallel_sizes(shape: Shape, hw: Hardware, rejected: list[str]) -> list[tuple[int, int]]:
    """(TP, PP) pairs with TP within a node dividing heads, query groups and the MLP width, PP dividing the layers and
    TP × PP dividing the ranks."""
    out = []
    for tp in _powers_of_two(hw.gpus_per_node):
        widths = (("ffn", shape.ffn),) if not shape.experts else (("expert ffn", shape.expert_ffn),
                                                                  ("shared ffn", shape.shared_ffn))
        bad = [f"{name} {v}" for name, v in (("heads", shape.heads), ("query groups", shape.groups), *widths) if v % tp]
        if bad:
            rejected.append(f"TP{tp}: does not divide {', '.join(bad)}")
            continue
        for pp in range(1, shape.layers + 1):
            if shape.layers % pp or hw.world() % (tp * pp):
                continue
            out.append((tp, pp))
    return out


def expert_parallel_sizes(shape: Shape, dp: int) -> list[int]:
    """Megatron's EP sizes for a mixture: powers of two dividing the data-parallel size and the expert count."""
    return [ep for ep in _powers_of_two(dp) if dp % ep == 0 and shape.experts % ep == 0] if shape.experts else [1]


def _batches(micro: int, dp: int, pp: int, global_batch: int | None) -> int | None:
    """The global batch for this DP size: the given one when micro × DP divides it, else None (invalid)."""
    if global_batch is None:
        return micro * dp * (4 * pp if pp > 1 else 1)  # ≥ 4 micro-batches per pipeline keeps the 1F1B bubble small
    return global_batch if global_batch % (micro * dp) == 0 else None


def candidate_layouts(shape: Shape, hw: Hardware, stage: str, micro: int, global_batch: int | None,
                      rejected: list[str]) -> list[Layout]:
    gpu = hw.device == "cuda"
    out = []
    model = memory_model(stage)
    if model.parallelism == Parallelism.MEGATRON:
        for tp, pp in megatron_parallel_sizes(shape, hw, rejected):
            dp = hw.world() // (tp * pp)
            gb = _batches(micro, dp, pp, global_batch)
            if gb is None:
                rejected.append(f"TP{tp} × PP{pp} × DP{dp}: global batch {global_batch} is not divisible by "
                                f"micro-batch {micro} × DP {dp}")
                continue
            for ep in expert_parallel_sizes(shape, dp):
                for rc in RECOMPUTE:
                    # Megatron's MoE layer trains under TP only with sequence parallel; with EP, baton keeps whole
                    # experts per rank (ETP 1), which is what its Mixtral export and resume are tested with
                    out.append(Layout(stage, tp, pp, dp, ep, micro, gb, distributed_optimizer=dp > 1,
                                      sequence_parallel=tp > 1 and (gpu or shape.experts > 0), recompute=rc,
                                      etp=1 if ep > 1 else None))
        return out
    dp = hw.world()
    gb = _batches(micro, dp, 1, global_batch)
    if gb is None:
        rejected.append(f"DP{dp}: global batch {global_batch} is not divisible by micro-batch {micro} × DP {dp}")
        return []
    for offload in ((False, False), (True, False), (True, True)):
        for rc in model.recomputes:
            for zs in (2, 3):
                if offload[1] and zs != 3:
                    continue
                out.append(Layout(stage, dp=dp, micro_batch=micro, global_batch=gb, zero_stage=zs, recompute=rc,
                                  offload_optimizer=offload[0] and gpu, offload_params=offload[1] and gpu))
    return out


def _preference(layout: Layout) -> tuple:
    """No offload and no full recompute if avoidable (both cost throughput; selective recompute costs little), then
    least model parallelism (TP before PP: TP stays within a node), then least expert parallel (its token exchange
    costs), then least recompute; ZeRO-2 before ZeRO-3."""
    return (layout.offload_optimizer + layout.offload_params, layout.recompute == "full", layout.tp * layout.pp,
            layout.pp, layout.ep, RECOMPUTE.index(layout.recompute), layout.zero_stage)


def plan(shape: Shape, hw: Hardware, stage: str = "pretrain", seq: int = 4096, micro: int = 1,
         global_batch: int | None = None, precision: str = "bf16", headroom: float = DEFAULT_HEADROOM) -> Plan:
    """The preferred layout whose estimate fits in the device's memory with `headroom` to spare, or the reason none
    does."""
    result = Plan(shape, hw, stage, seq, precision, headroom, strategy_for(shape.params()))
    layouts = sorted(candidate_layouts(shape, hw, stage, micro, global_batch, result.rejected), key=_preference)
    result.considered = len(layouts)
    if not layouts:
        result.reason = "no valid layout: " + "; ".join(result.rejected)
        return result
    best = None
    for layout in layouts:
        mem = breakdown(shape, layout, seq, precision, hw.device)
        if mem.total() <= result.budget():
            result.layout, result.memory = layout, mem
            return result
        if best is None or mem.total() < best[1].total():
            best = (layout, mem)
    result.reason = _why_not(best[0], best[1], result)
    return result


def _why_not(layout: Layout, mem: Breakdown, p: Plan) -> str:
    parts = {k: v for k, v in mem.as_gib().items() if k not in ("total", "activations_without_recompute")}
    largest = max(parts, key=parts.get)
    return (f"nothing fits: the smallest estimate, {mem.total() / GiB:.1f} GiB per rank ({layout.describe()}), "
            f"exceeds {p.budget() / GiB:.1f} GiB ({p.hardware.per_rank_bytes() / GiB:.0f} GiB per device less "
            f"{p.headroom:.0%} headroom); the largest part is {largest} at {parts[largest]:.1f} GiB — more devices, "
            "a shorter sequence or offload are needed")


# ---- disk ------------------------------------------------------------------------------------------------------------
HF_BYTES_PER_PARAM = FP32_BYTES   # the fp32 safetensors a stage's output (or its conversion) holds


def checkpoint_bytes_per_param(stage: str, precision: str) -> int:
    """What one training checkpoint holds per parameter on disk (gradients are never saved). Megatron and DeepSpeed:
    the weights in the training precision, the optimizer's fp32 copy of them (kept even when they are fp32: Megatron's
    distributed optimizer and ZeRO's flat partition) and Adam's two fp32 moments. TRL (the Trainer): the model as
    trained, fp32 under autocast, and the two moments."""
    moments = 2 * FP32_BYTES
    if not memory_model(stage).checkpoint_in_precision:
        return FP32_BYTES + moments
    return BYTES_OF_PRECISION[precision] + FP32_BYTES + moments


def stage_disk_bytes(cfg, stage: str) -> int:
    """A training stage's peak on disk: a save writes the new checkpoint before it removes the oldest kept one
    (keep + 1 at once), plus its fp32 output."""
    sc = cfg.stage_config(stage)
    per = checkpoint_bytes_per_param(stage, sc.precision)
    return shape_of_model(cfg.model).params() * (per * (sc.keep_checkpoints + 1) + HF_BYTES_PER_PARAM)


def planned_disk_bytes(cfg, stages) -> int:
    """What the given training stages of a run hold at once at the peak: each its kept checkpoints and its output,
    and one save in flight (the largest)."""
    params = shape_of_model(cfg.model).params()
    kept = largest = 0
    for stage in stages:
        sc = cfg.stage_config(stage)
        per = checkpoint_bytes_per_param(stage, sc.precision)
        kept += params * (per * sc.keep_checkpoints + HF_BYTES_PER_PARAM)
        largest = max(largest, params * per)
    return kept + largest


# ---- configs in and out ----------------------------------------------------------------------------------------------
def shape_of_model(model) -> Shape:
    """The pipeline's `model:` section as a Shape."""
    moe = model.moe
    experts = dict(experts=moe.num_experts, top_k=moe.top_k, expert_ffn=moe.expert_ffn(model),
                   shared_ffn=moe.shared_expert_ffn_hidden_size) if moe else {}
    return Shape(model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups,
                 model.ffn_hidden_size, model.vocab_size, model.tie_word_embeddings, **experts)


def layout_of_stage(stage: str, cfg, device: str) -> Layout:
    """The layout a stage section configures."""
    dp, gb, mb = cfg.data_parallel(), cfg.global_batch(), cfg.micro_batch_size
    if memory_model(stage).parallelism == Parallelism.MEGATRON:
        return Layout(stage, cfg.tensor_parallel, cfg.pipeline_parallel, dp, cfg.expert_parallel, mb, gb,
                      etp=cfg.expert_tensor_parallel,
                      distributed_optimizer=cfg.distributed_optimizer, sequence_parallel=cfg.sequence_parallel,
                      recompute=cfg.recompute_granularity)
    zero = getattr(cfg, "zero", None)
    recompute = "full" if getattr(cfg, "activation_checkpointing", False) else "none"
    return Layout(stage, dp=dp, micro_batch=mb, global_batch=gb, zero_stage=zero.stage if zero else 0,
                  recompute=recompute,
                  offload_optimizer=bool(zero and zero.offload_optimizer != "none" and device == "cuda"),
                  offload_params=bool(zero and zero.offload_params != "none" and device == "cuda"))


def predicted_peak_mb(cfg, stage: str) -> float:
    """`baton plan`'s per-rank estimate for the configured layout of a training stage, in MiB."""
    sc = cfg.stage_config(stage)
    device = sc.resolved_device()
    layout = layout_of_stage(stage, sc, device)
    seq = sc.max_seq_length or cfg.model.seq_length
    return breakdown(shape_of_model(cfg.model), layout, seq, sc.precision, device).total() / 2**20


def stage_block(p: Plan) -> dict:
    """A stage section in the shared vocabulary, ready to paste into a run config."""
    lay, hw = p.layout, p.hardware
    block = {"device": hw.device, "nproc_per_node": hw.gpus_per_node, "nnodes": hw.nodes,
             "micro_batch_size": lay.micro_batch, "global_batch_size": lay.global_batch, "max_seq_length": p.seq,
             "precision": p.precision if hw.device == "cuda" else "fp32"}
    block.update(memory_model(lay.stage).config_keys(lay))
    return {lay.stage: block}


def model_block(shape: Shape, seq: int) -> dict:
    block = {"num_layers": shape.layers, "hidden_size": shape.hidden, "num_attention_heads": shape.heads,
             "num_query_groups": shape.groups, "ffn_hidden_size": shape.ffn, "seq_length": seq,
             "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied}
    if shape.experts:
        block["moe"] = {"num_experts": shape.experts, "top_k": shape.top_k,
                        "expert_ffn_hidden_size": shape.expert_ffn,
                        "shared_expert_ffn_hidden_size": shape.shared_ffn}
    return {"model": block}


def describe_size(shape: Shape) -> str:
    """'46.70B parameters', with the active count of a mixture of experts."""
    def size(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    text = f"{size(shape.params())} parameters"
    if shape.experts:
        shared = f" and a shared expert of ffn {shape.shared_ffn}" if shape.shared_ffn else ""
        text += (f", {size(shape.params(active=True))} active per token (top-{shape.top_k} of {shape.experts} "
                 f"experts of ffn {shape.expert_ffn}{shared})")
    return text


def format_plan(p: Plan) -> str:
    hw, s = p.hardware, p.shape
    unit = "GPU" if hw.device == "cuda" else "CPU rank"
    mlp = f"ffn {s.ffn}" if not s.experts else "MoE MLP"
    lines = [f"model: {describe_size(s)}; {s.layers} layers, hidden {s.hidden}, {s.heads} heads, "
             f"{s.groups} query groups, {mlp}, vocab {s.vocab}; seq {p.seq}, {p.precision}",
             f"hardware: {hw.nodes} node(s) × {hw.gpus_per_node} {unit}(s), {hw.per_rank_bytes() / GiB:.1f} GiB per "
             f"rank",
             f"size guide: {p.strategy}"]
    for r in p.rejected:
        lines.append(f"  refused {r}")
    if p.layout is None:
        lines.append(f"no layout fits ({p.considered} considered): {p.reason}")
        return "\n".join(lines)
    lines.append(f"layout ({p.stage}): {p.layout.describe()}; micro-batch {p.layout.micro_batch}, global batch "
                 f"{p.layout.global_batch}")
    lines += format_breakdown(p.memory, hw.per_rank_bytes(), p.headroom)
    return "\n".join(lines)


def format_breakdown(mem: Breakdown, capacity: float, headroom: float) -> list[str]:
    g = mem.as_gib()
    lines = ["memory per rank (GiB):"]
    for key in ("weights", "gradients", "optimizer", "activations", "buffers"):
        lines.append(f"  {key:<12} {g[key]:>9.2f}")
    lines.append(f"  {'total':<12} {g['total']:>9.2f}   (activations without recompute: "
                 f"{g['activations_without_recompute']:.2f})")
    margin = capacity - mem.total()
    lines.append(f"  margin       {margin / GiB:>9.2f}   of {capacity / GiB:.1f} GiB ({margin / capacity:.0%} free; "
                 f"plan keeps ≥ {headroom:.0%})")
    return lines
