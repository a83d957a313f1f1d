"""Megatron-Core dist checkpoints (torch_dist) ⇄ Hugging Face safetensors of the Llama family (`LlamaForCausalLM`,
`MistralForCausalLM` in), of Qwen2 (`Qwen2ForCausalLM`: the Llama layout plus q/k/v biases) and of Qwen3
(`Qwen3ForCausalLM`: the Llama layout plus an RMSNorm over each head's queries and keys before RoPE, Megatron's
`q_layernorm` / `k_layernorm` [layers, head_dim], HF's `self_attn.q_norm` / `k_norm`).

A torch_dist checkpoint stores every weight as one global tensor (whatever TP/PP layout wrote it), transformer layers
stacked on a leading axis: `decoder.layers.self_attention.linear_qkv.weight` is [layers, (heads + 2·groups)·head_dim,
hidden]. We read it with baton's own torch_dist reader (conversions/torch_dist: `.metadata` parsed once by the
restricted loader, chunks read from the `.distcp` byte ranges) one output tensor's box at a time, streamed into the
shards, so the conversion holds about 1.5 × the largest tensor plus one layer's qkv slice, whatever the shard size; no
process group, no megatron and no torch.distributed.checkpoint import are needed (from_hf and rewrite still write
with it: Megatron loads only folders baton wrote, see `rewrite`).

Megatron layouts that differ from HF:
- linear_qkv interleaves per query group: [q heads of the group | k | v] for each group, its bias (Qwen2's q/k/v
  biases, TransformerConfig.add_qkv_bias) the same way;
- linear_fc1 is [gate; up] (SwiGLU);
- embedding and output rows are padded (to a multiple of make_vocab_size_divisible_by × TP): rows past the
  tokenizer's vocabulary are dropped on export and zero-filled on import;
- layer norms live under the TE names (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) for both the
  local and the Transformer Engine layer specs, a mixture of experts' pre-MLP norm too.

A mixture of experts (the architecture's `moe`) is HF's Mixtral for a Llama family model, Qwen3-MoE for a Qwen3 one:
the router `decoder.layers.mlp.router.weight` [layers, experts, hidden] is `block_sparse_moe.gate.weight` (Qwen3-MoE:
`mlp.gate.weight`), and the experts are stacked on a second axis, `decoder.layers.mlp.experts.experts.linear_fc1.weight`
[layers, experts, 2·ffn, hidden] ([gate; up] as the dense fc1: Mixtral's w1 and w3, Qwen3-MoE's gate_proj and
up_proj) and `linear_fc2` [layers, experts, hidden, ffn] (w2, down_proj), whatever EP layout wrote them.
"""
from __future__ import annotations

import json
import math
import warnings
import zipfile
from pathlib import Path

from . import hf, manifest as mf, probe, safetensors_stream, torch_dist, torch_lazy
from .refusal import Refused

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
LAYER = {
    "input_norm": "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
    "qkv": "decoder.layers.self_attention.linear_qkv.weight",
    "proj": "decoder.layers.self_attention.linear_proj.weight",
    "mlp_norm": "decoder.layers.mlp.linear_fc1.layer_norm_weight",
    "fc1": "decoder.layers.mlp.linear_fc1.weight",
    "fc2": "decoder.layers.mlp.linear_fc2.weight",
}
COMMON_FILE = "common.pt"
METADATA_FILE = "metadata.json"
TORCH_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}
QKV_BIAS = "decoder.layers.self_attention.linear_qkv.bias"  # only in families with q/k/v biases
MOE_LAYER = {  # a mixture of experts' MLP: the router and the experts, in place of LAYER's fc1 and fc2
    "router": "decoder.layers.mlp.router.weight",
    "experts_fc1": "decoder.layers.mlp.experts.experts.linear_fc1.weight",
    "experts_fc2": "decoder.layers.mlp.experts.experts.linear_fc2.weight",
}
QK_NORM = {"q_norm": "decoder.layers.self_attention.q_layernorm.weight",  # only in families with q/k norms
           "k_norm": "decoder.layers.self_attention.k_layernorm.weight"}
# Each family's HF names for one layer's mixture of experts, under model.layers.<i>.: the router, and expert e's
# projections (gate, up, down) in the name pattern.
HF_MOE = {"llama": {"router": "block_sparse_moe.gate.weight", "expert": "block_sparse_moe.experts.{e}.{w}.weight",
                    "gate": "w1", "up": "w3", "down": "w2"},                                    # Mixtral
          "qwen3": {"router": "mlp.gate.weight", "expert": "mlp.experts.{e}.{w}.weight",
                    "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}}               # Qwen3-MoE
ARCH_KEY = "baton_architecture"   # common.pt entry: the checkpoint describes its own architecture
# The HF architectures from_hf maps onto Megatron's GPT, and the family each is recorded as (the architecture dict's
# `arch`, the pipeline's model.arch); the export writes the family's HF class back (a Mistral comes back a Llama).
FAMILY_OF_HF = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                "MixtralForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3"}
FROM_HF_ARCHITECTURES = tuple(FAMILY_OF_HF)
QKV_BIAS_FAMILIES = ("qwen2",)
QK_NORM_FAMILIES = ("qwen3",)
PROBE_MAX_PARAMS = 2_000_000_000  # from_hf computes the HF model's probe logits up to this size (one fp32 copy)


class MegatronCheckpointError(Refused):
    pass


def padded_vocab_size(vocab: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's rule: embedding rows padded up to a multiple of divisible_by × TP."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)


def family(arch: dict) -> str:
    """The architecture dict's family; one without `arch` (written before Qwen2 was mapped) is a Llama."""
    return arch.get("arch") or "llama"


def has_qkv_bias(arch: dict) -> bool:
    return family(arch) in QKV_BIAS_FAMILIES


def has_qk_norm(arch: dict) -> bool:
    return family(arch) in QK_NORM_FAMILIES


def layer_keys(arch: dict) -> dict[str, str]:
    """The stacked per-layer tensors of this family: LAYER, plus the fused q/k/v bias or the q/k norms where it has
    them; a mixture of experts' router and experts in place of the dense fc1 and fc2."""
    keys = {**LAYER, "qkv_bias": QKV_BIAS} if has_qkv_bias(arch) else dict(LAYER)
    if has_qk_norm(arch):
        keys.update(QK_NORM)
    if moe(arch):
        del keys["fc1"], keys["fc2"]
        keys.update(MOE_LAYER)
    return keys


def moe(arch: dict) -> dict | None:
    """The architecture dict's mixture of experts (model.moe's keys), or None for a dense MLP."""
    value = arch.get("moe")
    return value if isinstance(value, dict) and value.get("num_experts") else None


def expert_ffn(arch: dict) -> int:
    """One expert's SwiGLU width: model.moe.expert_ffn_hidden_size, else the dense model.ffn_hidden_size."""
    return int(moe(arch).get("expert_ffn_hidden_size") or arch["ffn_hidden_size"])


def moe_transformer_fields(arch: dict) -> dict:
    """model.moe in Megatron-Core's TransformerConfig names (hf.MOE_NAMES, the one table of both vocabularies)."""
    m = moe(arch)
    if m is None:
        return {}
    values = {**m, "expert_ffn_hidden_size": expert_ffn(arch)}
    fields = {hf.MOE_NAMES[key][0]: values[key] for key in hf.MOE_NAMES if values.get(key) is not None}
    if not fields.get("moe_shared_expert_intermediate_size"):
        fields.pop("moe_shared_expert_intermediate_size", None)  # Megatron reads 0 as a shared expert of width 0
    return fields


def is_dist_checkpoint(root: Path) -> bool:
    root = Path(root)
    return (root / ".metadata").exists() and (root / METADATA_FILE).exists()


def read_common(root: Path) -> dict:
    """common.pt through baton's restricted loader: a crafted file is refused before anything in it runs."""
    path = Path(root) / COMMON_FILE
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        common = torch_lazy.load(path)
    except (torch_lazy.UnsafeCheckpointError, ValueError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MegatronCheckpointError(f"{path}: refused: not a plain weights file ({first}); nothing in it was run")
    if not isinstance(common, dict):
        raise MegatronCheckpointError(f"{path}: refused: not a dict of common entries")
    return common


def check_metadata(root: Path) -> torch_dist.DistMetadata | None:
    """`.metadata` parsed by the restricted loader into plain records (None when there is none)."""
    path = Path(root) / torch_dist.METADATA
    if not path.exists() and not path.is_symlink():
        return None
    try:
        return torch_dist.read_metadata(root)
    except torch_lazy.UnsafeCheckpointError as e:
        raise MegatronCheckpointError(f"refused: {e}") from None


def architecture(root: Path) -> dict:
    """The architecture a checkpoint was written with: common.pt first, then the manifest."""
    check_metadata(root)
    arch = dict(read_common(root).get(ARCH_KEY) or {})
    if not arch:
        m = mf.read(root) or {}
        arch = dict(m.get("architecture") or {})
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")
               if k not in arch]
    if missing:
        raise MegatronCheckpointError(f"{root}: architecture lacks {missing} (neither {COMMON_FILE} nor the manifest "
                                      "describe the model)")
    if not isinstance(family(arch), str) or family(arch) not in set(FAMILY_OF_HF.values()):
        raise MegatronCheckpointError(f"{root}: architecture family {arch.get('arch')!r} is not one baton maps "
                                      f"({', '.join(sorted(set(FAMILY_OF_HF.values())))})")
    arch.setdefault("num_query_groups", arch["num_attention_heads"])
    return arch


class DistReader:
    """Read boxes of the global tensors of a torch_dist checkpoint, from what its `.metadata` was parsed into once."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not is_dist_checkpoint(self.root):
            raise MegatronCheckpointError(f"{root}: not a Megatron torch_dist checkpoint (.metadata / {METADATA_FILE})")
        try:
            backend = json.loads((self.root / METADATA_FILE).read_text()).get("sharded_backend")
        except (ValueError, RecursionError, AttributeError):
            raise MegatronCheckpointError(f"{root}: {METADATA_FILE} is not a JSON object") from None
        if backend != "torch_dist":
            raise MegatronCheckpointError(f"{root}: sharded backend {backend!r}; only torch_dist is supported")
        self.metadata = check_metadata(self.root)
        self._chunks = {}  # Chunk -> its LazyTensor: each blob's zip directory is read once

    def shape(self, key: str) -> tuple[int, ...] | None:
        md = self.metadata.state_dict_metadata.get(key)
        return tuple(md.size) if isinstance(md, torch_dist.TensorEntry) else None

    def dtype(self, key: str):
        return self.metadata.state_dict_metadata[key].dtype

    def read(self, requests: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict:
        """{key: (offsets, sizes)} -> {key: tensor of that box of the global tensor}."""
        for key in requests:
            if self.shape(key) is None:
                raise MegatronCheckpointError(f"{self.root}: no tensor {key!r} in the checkpoint")
        try:
            return {key: torch_dist.read_box(self.root, key, self.metadata.state_dict_metadata[key], offsets, sizes,
                                             self._chunks) for key, (offsets, sizes) in requests.items()}
        except torch_lazy.UnsafeCheckpointError as e:
            raise MegatronCheckpointError(f"refused: {e}") from None

    def read_full(self, key: str):
        shape = self.shape(key)
        if shape is None:
            raise MegatronCheckpointError(f"{self.root}: no tensor {key!r} in the checkpoint")
        return self.read({key: ((0,) * len(shape), shape)})[key]


# ---- Megatron → HF ----------------------------------------------------------------------------------------------
def split_qkv(qkv, heads: int, groups: int, head_dim: int):
    """[groups·(heads/groups + 2)·head_dim, *rest] → q [heads·d, *rest], k [groups·d, *rest], v [groups·d, *rest]:
    the weight (rest = hidden) or the bias (no rest)."""
    per = heads // groups
    rest = tuple(qkv.shape[1:])
    g = qkv.reshape(groups, (per + 2) * head_dim, *rest)
    q = g[:, : per * head_dim].reshape(heads * head_dim, *rest)
    k = g[:, per * head_dim: (per + 1) * head_dim].reshape(groups * head_dim, *rest)
    v = g[:, (per + 1) * head_dim:].reshape(groups * head_dim, *rest)
    return q, k, v


def merge_qkv(q, k, v, heads: int, groups: int, head_dim: int):
    import torch

    per = heads // groups
    rest = tuple(q.shape[1:])
    return torch.cat([q.reshape(groups, per * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest)


def _tokenizer_ids(tok_dir: Path) -> dict:
    ids = {}
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    except Exception:  # no tokenizer: the config simply has no special ids
        pass
    return {k: v for k, v in ids.items() if v is not None}


class _QkvSlice:
    """One layer's linear_qkv slice, read when q, k or v of that layer is first asked for and kept until the next
    layer's is: the three come from one read, and no more than one slice is held."""

    def __init__(self, reader: DistReader):
        self.reader, self.layer, self.value = reader, None, None

    def get(self, i: int):
        if self.layer != i:
            self.value = None
            self.value, self.layer = _layer_box(self.reader, LAYER["qkv"], i), i
        return self.value


def _layer_box(r: DistReader, key: str, i: int, rows: tuple[int, int] | None = None):
    """Layer i of a stacked tensor (rows [lo, hi) of it when given), read alone."""
    shape = r.shape(key)
    lo, hi = rows or (0, shape[1])
    return r.read({key: ((i, lo) + (0,) * (len(shape) - 2), (1, hi - lo) + shape[2:])})[key][0]


def hf_plan(r: DistReader, arch: dict) -> list[safetensors_stream.PlannedTensor]:
    """Every HF tensor with its shape and a reader of just its box of the dist checkpoint: the streaming writer then
    holds at most 1.5 × the largest tensor (plus one layer's qkv), whatever the shard size."""
    heads, groups, hidden = arch["num_attention_heads"], arch["num_query_groups"], arch["hidden_size"]
    head_dim = arch.get("kv_channels") or hidden // heads
    vocab, layers = int(arch["vocab_size"]), r.shape(LAYER["qkv"])[0]
    experts = moe(arch)
    ffn = (r.shape(MOE_LAYER["experts_fc1"])[2] if experts else r.shape(LAYER["fc1"])[1]) // 2
    qkv = _QkvSlice(r)
    plan = []

    def add(name, key, shape, produce):
        plan.append(safetensors_stream.PlannedTensor(name, r.dtype(key), tuple(shape), produce))

    def rows(key):  # the tokenizer's rows only: padding is dropped here
        return lambda: r.read({key: ((0, 0), (vocab, hidden))})[key]

    def whole(role, i):
        return lambda: _layer_box(r, LAYER[role], i)

    def part(n, i):  # q, k or v of layer i
        return lambda: split_qkv(qkv.get(i), heads, groups, head_dim)[n]

    def qk_norm(role, i):  # Qwen3's per-head RMSNorm of layer i's queries or keys
        return lambda: _layer_box(r, QK_NORM[role], i)

    def bias_part(n, i):  # q, k or v bias of layer i (a few KB: read per use)
        return lambda: split_qkv(_layer_box(r, QKV_BIAS, i), heads, groups, head_dim)[n]

    def half(lo, i):  # gate (rows [0, ffn)) or up (rows [ffn, 2·ffn)) of linear_fc1
        return lambda: _layer_box(r, LAYER["fc1"], i, (lo, lo + ffn))

    def expert(role, i, e, rows=None):  # expert e of layer i: its fc2, or rows [lo, hi) of its fc1
        key = MOE_LAYER[role]
        shape = r.shape(key)
        lo, hi = rows or (0, shape[2])
        return lambda: r.read({key: ((i, e, lo, 0), (1, 1, hi - lo, shape[3]))})[key][0, 0]

    def mlp(p, i):
        if not experts:
            add(p + "mlp.gate_proj.weight", LAYER["fc1"], (ffn, hidden), half(0, i))
            add(p + "mlp.up_proj.weight", LAYER["fc1"], (ffn, hidden), half(ffn, i))
            add(p + "mlp.down_proj.weight", LAYER["fc2"], r.shape(LAYER["fc2"])[1:], whole("fc2", i))
            return
        names = hf_moe_names(arch)
        add(p + names["router"], MOE_LAYER["router"], r.shape(MOE_LAYER["router"])[1:], whole_moe("router", i))
        for e in range(r.shape(MOE_LAYER["router"])[1]):
            name = p + names["expert"]
            add(name.format(e=e, w=names["gate"]), MOE_LAYER["experts_fc1"], (ffn, hidden),
                expert("experts_fc1", i, e, (0, ffn)))
            add(name.format(e=e, w=names["down"]), MOE_LAYER["experts_fc2"], r.shape(MOE_LAYER["experts_fc2"])[2:],
                expert("experts_fc2", i, e))
            add(name.format(e=e, w=names["up"]), MOE_LAYER["experts_fc1"], (ffn, hidden),
                expert("experts_fc1", i, e, (ffn, 2 * ffn)))

    def whole_moe(role, i):
        return lambda: _layer_box(r, MOE_LAYER[role], i)

    add("model.embed_tokens.weight", EMBEDDING, (vocab, hidden), rows(EMBEDDING))
    if not arch.get("tie_word_embeddings", False):
        add("lm_head.weight", OUTPUT, (vocab, hidden), rows(OUTPUT))
    add("model.norm.weight", FINAL_NORM, r.shape(FINAL_NORM), lambda: r.read_full(FINAL_NORM))
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", LAYER["input_norm"], (hidden,), whole("input_norm", i))
        add(p + "self_attn.q_proj.weight", LAYER["qkv"], (heads * head_dim, hidden), part(0, i))
        add(p + "self_attn.k_proj.weight", LAYER["qkv"], (groups * head_dim, hidden), part(1, i))
        add(p + "self_attn.v_proj.weight", LAYER["qkv"], (groups * head_dim, hidden), part(2, i))
        if has_qkv_bias(arch):
            add(p + "self_attn.q_proj.bias", QKV_BIAS, (heads * head_dim,), bias_part(0, i))
            add(p + "self_attn.k_proj.bias", QKV_BIAS, (groups * head_dim,), bias_part(1, i))
            add(p + "self_attn.v_proj.bias", QKV_BIAS, (groups * head_dim,), bias_part(2, i))
        if has_qk_norm(arch):
            add(p + "self_attn.q_norm.weight", QK_NORM["q_norm"], (head_dim,), qk_norm("q_norm", i))
            add(p + "self_attn.k_norm.weight", QK_NORM["k_norm"], (head_dim,), qk_norm("k_norm", i))
        add(p + "self_attn.o_proj.weight", LAYER["proj"], r.shape(LAYER["proj"])[1:], whole("proj", i))
        add(p + "post_attention_layernorm.weight", LAYER["mlp_norm"], (hidden,), whole("mlp_norm", i))
        mlp(p, i)
    return plan


def to_hf(src: Path, dst: Path, *, max_shard_bytes: int = 2 << 30) -> dict:
    """Any TP/PP layout → one HF folder: weights, config.json, generation config, tokenizer and chat template."""
    src, dst = Path(src), Path(dst)
    r = DistReader(src)
    arch = architecture(src)
    vocab = int(arch["vocab_size"])
    emb_shape = r.shape(EMBEDDING)
    if emb_shape is None:
        raise MegatronCheckpointError(f"{src}: no {EMBEDDING}")
    padded = emb_shape[0]
    if padded < vocab:
        raise MegatronCheckpointError(f"{src}: embedding has {padded} rows, fewer than the vocabulary ({vocab})")
    layers = r.shape(LAYER["qkv"])[0]
    if layers != arch["num_layers"]:
        raise MegatronCheckpointError(f"{src}: {layers} layers in the weights, {arch['num_layers']} in the architecture")
    tied = bool(arch.get("tie_word_embeddings", False))
    if not tied and r.shape(OUTPUT) is None:
        raise MegatronCheckpointError(f"{src}: untied embeddings but no {OUTPUT} in the checkpoint")
    if has_qkv_bias(arch) and r.shape(QKV_BIAS) is None:
        raise MegatronCheckpointError(f"{src}: a {family(arch)} model without {QKV_BIAS} in the checkpoint")
    missing = [k for k in layer_keys(arch).values() if r.shape(k) is None]
    if missing:
        raise MegatronCheckpointError(f"{src}: no {missing[0]} in the checkpoint (its architecture "
                                      f"{'has' if moe(arch) else 'has no'} mixture of experts)")
    if moe(arch) and r.shape(MOE_LAYER["router"])[1] != moe(arch)["num_experts"]:
        raise MegatronCheckpointError(f"{src}: {r.shape(MOE_LAYER['router'])[1]} experts in the weights, "
                                      f"{moe(arch)['num_experts']} in the architecture")

    safetensors_stream.write(dst, hf_plan(r, arch), max_shard_bytes)
    tok_src = src / "tokenizer"
    dtype = str(r.dtype(EMBEDDING)).replace("torch.", "")
    config = hf.decoder_config({**arch, "num_layers": layers}, vocab_size=vocab, **_tokenizer_ids(tok_src))
    config.dtype = dtype
    hf.write_config_and_generation(dst, config)
    copied = hf.copy_tokenizer(tok_src, dst) if tok_src.exists() else []
    return {"parameter_count": hf.parameter_count(dst), "dtype": dtype, "vocab_size": vocab,
            "padded_vocab_size": padded, "padding_rows_removed": padded - vocab, "tied_embeddings": tied,
            "tokenizer_files": copied}


# ---- HF → Megatron ----------------------------------------------------------------------------------------------
def hf_family(config: dict) -> str:
    """The family an HF config.json maps to (see FAMILY_OF_HF)."""
    return next((FAMILY_OF_HF[a] for a in mapped_architectures(config)), "llama")


def mapped_architectures(config: dict) -> list[str]:
    """config.json's architectures that from_hf maps (an untrusted file: any non-string entry is no match)."""
    archs = config.get("architectures")
    return [a for a in archs if isinstance(a, str) and a in FAMILY_OF_HF] if isinstance(archs, list) else []


def hf_architecture(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return {
        "arch": hf_family(config),
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": heads, "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": config["intermediate_size"], "seq_length": config.get("max_position_embeddings", 2048),
        "vocab_size": config["vocab_size"], "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_theta": float(config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "norm_eps": config.get("rms_norm_eps", 1e-5), "init_std": config.get("initializer_range", 0.02),
        "kv_channels": config.get("head_dim") or config["hidden_size"] // heads,
        **({"moe": experts} if (experts := hf.moe_of_hf_config(config)) else {}),
    }


def from_hf_problem(config: dict) -> str | None:
    """Why an HF config.json does not map onto Megatron's GPT as baton builds it (None when it does): another
    architecture, or a variant of a mapped one with parts the mapping would drop."""
    archs = config.get("architectures") or []
    mapped = mapped_architectures(config)
    if not mapped:
        return f"architectures {archs}: only {', '.join(FROM_HF_ARCHITECTURES)} convert to Megatron"
    if FAMILY_OF_HF[mapped[0]] == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
        return f"architectures {archs} with attention_bias/mlp_bias: the Llama mapping has no biases to carry them"
    layer_types = set(config.get("layer_types") or ["full_attention"])
    if config.get("use_sliding_window") or layer_types != {"full_attention"}:
        return f"architectures {archs} with sliding-window layers: Megatron's GPT here attends to the full context"
    if FAMILY_OF_HF[mapped[0]] == "qwen3":
        return _qwen3_problem(config, archs)
    return None


def _qwen3_problem(config: dict, archs: list) -> str | None:
    """A Qwen3 (or Qwen3-MoE) whose shape Megatron's GPT here does not take: a head width other than hidden / heads
    (the pretrain worker's kv_channels), q/k/v biases, dense MLPs among the experts' layers, or routing weights not
    renormalised over the top-k (Megatron's softmax over the top-k logits is HF's norm_topk_prob)."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    if config.get("head_dim") not in (None, hidden // heads):
        return (f"architectures {archs} with head_dim {config['head_dim']}: Megatron's GPT here has hidden_size / "
                f"num_attention_heads = {hidden // heads}")
    if config.get("attention_bias"):
        return f"architectures {archs} with attention_bias: the Qwen3 mapping has no biases to carry them"
    experts = hf.moe_of_hf_config(config)  # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
    if experts and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        return (f"architectures {archs} with dense MLP layers among the experts' (mlp_only_layers "
                f"{config.get('mlp_only_layers')}, decoder_sparse_step {config.get('decoder_sparse_step')}): "
                "Megatron's GPT here has experts in every layer")
    if experts and not config.get("norm_topk_prob"):
        return (f"architectures {archs} with norm_topk_prob false: Megatron routes with the top-k weights "
                "renormalised (HF's norm_topk_prob true)")
    return None


def from_hf(src: Path, dst: Path, *, max_shard_bytes: int = 2 << 30, divisible_by: int = 128) -> dict:
    """HF Llama or Qwen2 folder → a weights-only torch_dist checkpoint a Megatron run can start from (any TP/PP
    layout)."""
    import torch
    from safetensors import safe_open

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    archs = config.get("architectures") or []
    if problem := from_hf_problem(config):
        raise MegatronCheckpointError(f"{src}: {problem}")
    arch = hf_architecture(config)
    heads, groups, head_dim = arch["num_attention_heads"], arch["num_query_groups"], arch["kv_channels"]
    layers, vocab, hidden = arch["num_layers"], arch["vocab_size"], arch["hidden_size"]
    padded = padded_vocab_size(vocab, divisible_by)
    arch["padded_vocab_size"] = padded
    dst.mkdir(parents=True, exist_ok=True)

    n_params = hf.parameter_count(src)
    if n_params <= PROBE_MAX_PARAMS:  # the HF model's logits, for the L2 check of whoever loads this checkpoint
        ids = probe.probe_input_ids(vocab)
        probe.save_reference(dst, ids, probe.hf_logits(src, ids, "float32"), source=f"transformers {archs[0]} {src}")

    handles = {}
    for f in hf.safetensors_files(src):
        h = safe_open(str(f), framework="pt")
        for name in h.keys():
            handles[name] = h

    def get(name):
        if name not in handles:
            raise MegatronCheckpointError(f"{src}: no tensor {name!r}")
        return handles[name].get_tensor(name)

    embed = get("model.embed_tokens.weight")
    dtype = embed.dtype

    def padded_rows(t):
        out = torch.zeros((padded, hidden), dtype=dtype)
        out[:vocab] = t
        return out

    state = {EMBEDDING: padded_rows(embed), FINAL_NORM: get("model.norm.weight")}
    del embed
    if not arch["tie_word_embeddings"]:
        state[OUTPUT] = padded_rows(get("lm_head.weight"))
    keys = layer_keys(arch)
    stacked = {role: None for role in keys}
    for i in range(layers):
        p = f"model.layers.{i}."
        per = {
            "input_norm": get(p + "input_layernorm.weight"),
            "qkv": merge_qkv(get(p + "self_attn.q_proj.weight"), get(p + "self_attn.k_proj.weight"),
                             get(p + "self_attn.v_proj.weight"), heads, groups, head_dim),
            "proj": get(p + "self_attn.o_proj.weight"),
            "mlp_norm": get(p + "post_attention_layernorm.weight"),
            **(_hf_experts(get, p, arch) if moe(arch) else {
                "fc1": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0),
                "fc2": get(p + "mlp.down_proj.weight")}),
        }
        if "q_norm" in keys:
            per["q_norm"], per["k_norm"] = get(p + "self_attn.q_norm.weight"), get(p + "self_attn.k_norm.weight")
        if "qkv_bias" in keys:
            per["qkv_bias"] = merge_qkv(get(p + "self_attn.q_proj.bias"), get(p + "self_attn.k_proj.bias"),
                                        get(p + "self_attn.v_proj.bias"), heads, groups, head_dim)
        for role, t in per.items():
            if stacked[role] is None:
                stacked[role] = torch.empty((layers, *t.shape), dtype=t.dtype)
            stacked[role][i] = t
    state.update({keys[role]: t for role, t in stacked.items()})

    _write_weights_only(state, arch, dst)
    copied = hf.copy_tokenizer(src, dst / "tokenizer")
    n = sum(t.numel() for t in state.values())
    return {"parameter_count": n, "dtype": str(dtype).replace("torch.", ""), "vocab_size": vocab,
            "padded_vocab_size": padded, "architecture": arch, "tokenizer_files": copied, "weights_only": True}


def hf_moe_names(arch: dict) -> dict:
    """The family's HF names for a layer's mixture of experts (HF_MOE)."""
    if family(arch) not in HF_MOE:
        raise MegatronCheckpointError(f"model.arch {family(arch)} with model.moe: no HF mixture-of-experts layout for "
                                      f"it (mapped: {', '.join(HF_MOE)})")
    return HF_MOE[family(arch)]


def _hf_experts(get, p: str, arch: dict) -> dict:
    """One layer's router and experts (files under model.layers.<i>.) as Megatron stacks them per layer."""
    import torch

    names = hf_moe_names(arch)
    experts = [{role: p + names["expert"].format(e=e, w=names[role]) for role in ("gate", "up", "down")}
               for e in range(moe(arch)["num_experts"])]
    return {"router": get(p + names["router"]),
            "experts_fc1": torch.stack([torch.cat([get(e["gate"]), get(e["up"])], dim=0) for e in experts]),
            "experts_fc2": torch.stack([get(e["down"]) for e in experts])}


def _write_weights_only(state: dict, arch: dict, dst: Path) -> None:
    """The folder a Megatron run starts from: the weights (torch's own torch_dist writer), common.pt with the
    architecture, metadata.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    torch.save({ARCH_KEY: arch}, str(dst / COMMON_FILE))
    (dst / METADATA_FILE).write_text(json.dumps(TORCH_DIST_METADATA))


def _plain(value) -> bool:
    """A value the rewritten common.pt may carry: a scalar, or a flat dict of them (the architecture's `moe`)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and (v is None or type(v) in (bool, int, float, str)) for k, v in value.items())
    return type(value) in (bool, int, float, str)


def rewrite(src: Path, dst: Path) -> dict:
    """A torch_dist checkpoint baton did not write → a fresh weights-only one it did, from the tensors its own reader
    parsed (the weights from_hf writes, bit for bit) and the source's probe logits: what a Megatron run may start from.
    Megatron's loader unpickles `.metadata` (and common.pt) again with plain pickle, where a crafted file runs code
    that baton's restricted reader only ever sees as inert records."""
    src, dst = Path(src), Path(dst)
    reader = DistReader(src)
    arch = {k: v for k, v in architecture(src).items() if _plain(v)}
    keys = [EMBEDDING, FINAL_NORM, *layer_keys(arch).values(),
            *([] if arch.get("tie_word_embeddings") else [OUTPUT])]
    missing = [k for k in keys if reader.shape(k) is None]
    if missing:
        raise MegatronCheckpointError(f"{src}: no {missing[0]} (not a GPT checkpoint baton can start from)")
    dst.mkdir(parents=True, exist_ok=True)
    _write_weights_only({k: reader.read_full(k) for k in keys}, arch, dst)
    if (src / probe.PROBE_FILE).is_file():  # safetensors: parsed once here, our own copy for the L2 check
        ids, logits = probe.load_reference(src)
        probe.save_reference(dst, ids, logits, source=f"{src}, rewritten by baton")
    return {"architecture": arch, "tensors": len(keys)}
