"""Hugging Face safetensors checkpoints: the hand-off format between stages and the one servers load."""
from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Iterator

from . import folder, manifest as mf
from .refusal import Refused
from .safetensors_stream import DTYPE_CODES

def _decoder_fields(arch: dict, vocab_size: int | None) -> dict:
    """What LlamaConfig and Qwen2Config share, from baton's architecture dict."""
    heads = arch["num_attention_heads"]
    return dict(
        vocab_size=vocab_size or arch["vocab_size"],
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["ffn_hidden_size"],
        num_hidden_layers=arch["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=arch.get("num_query_groups") or heads,
        max_position_embeddings=arch["seq_length"],
        rms_norm_eps=arch.get("norm_eps", 1e-5),
        rope_theta=arch.get("rope_theta", 10000.0),
        tie_word_embeddings=arch.get("tie_word_embeddings", False),
        initializer_range=arch.get("init_std", 0.02),
        hidden_act="silu",
        torch_dtype="float32",
    )


def llama_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """transformers.LlamaConfig for baton's architecture dict (the pipeline's `model:` section)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_decoder_fields(arch, vocab_size), head_dim=arch["hidden_size"] // arch["num_attention_heads"],
                       attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"], **special_tokens)


def qwen2_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """transformers.Qwen2Config (q/k/v biases, every layer full attention) for baton's architecture dict."""
    from transformers import Qwen2Config

    return Qwen2Config(**_decoder_fields(arch, vocab_size), use_sliding_window=False,
                       architectures=["Qwen2ForCausalLM"], **special_tokens)


def mixtral_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """transformers.MixtralConfig: a Llama whose every MLP is a mixture of experts (the architecture dict's `moe`)."""
    from transformers import MixtralConfig

    moe = arch["moe"]
    fields = {**_decoder_fields(arch, vocab_size),
              "intermediate_size": moe.get("expert_ffn_hidden_size") or arch["ffn_hidden_size"]}
    return MixtralConfig(**fields, head_dim=arch["hidden_size"] // arch["num_attention_heads"],
                         num_local_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"],
                         router_aux_loss_coef=moe.get("aux_loss_coef") or 0.0, router_jitter_noise=0.0,
                         sliding_window=None, architectures=["MixtralForCausalLM"], **special_tokens)


def _qwen3_fields(arch: dict) -> dict:
    """What Qwen3Config and Qwen3MoeConfig add to the shared decoder fields: the head width stated (its default is
    128, not hidden / heads), no q/k/v biases, every layer full attention."""
    return dict(head_dim=arch["hidden_size"] // arch["num_attention_heads"], attention_bias=False,
                use_sliding_window=False)


def qwen3_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """transformers.Qwen3Config (per-head q/k RMSNorm) for baton's architecture dict."""
    from transformers import Qwen3Config

    return Qwen3Config(**_decoder_fields(arch, vocab_size), **_qwen3_fields(arch), architectures=["Qwen3ForCausalLM"],
                       **special_tokens)


def qwen3_moe_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """transformers.Qwen3MoeConfig: a Qwen3 whose every MLP is a mixture of experts, the top-k routing weights
    renormalised as Megatron routes (norm_topk_prob)."""
    from transformers import Qwen3MoeConfig

    moe = arch["moe"]
    return Qwen3MoeConfig(**_decoder_fields(arch, vocab_size), **_qwen3_fields(arch),
                          num_experts=moe["num_experts"], num_experts_per_tok=moe["top_k"],
                          moe_intermediate_size=moe.get("expert_ffn_hidden_size") or arch["ffn_hidden_size"],
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=moe.get("aux_loss_coef") or 0.0,
                          architectures=["Qwen3MoeForCausalLM"], **special_tokens)


DECODER_CONFIGS = {"llama": llama_config, "qwen2": qwen2_config, "qwen3": qwen3_config}  # the dict's `arch`
MOE_DECODER_CONFIGS = {"llama": mixtral_config, "qwen3": qwen3_moe_config}  # with model.moe: the MLPs are experts


def decoder_config(arch: dict, vocab_size: int | None = None, **special_tokens):
    """The transformers config of the architecture dict's family (`arch`; a dict without one is a Llama), its MoE
    form when the dict has `moe`."""
    family = arch.get("arch") or "llama"
    if arch.get("moe"):
        if family not in MOE_DECODER_CONFIGS:
            raise Refused(f"model.arch {family} with model.moe: no HF mixture-of-experts layout for it (mapped: "
                          f"llama → Mixtral, qwen3 → Qwen3-MoE)")
        return MOE_DECODER_CONFIGS[family](arch, vocab_size, **special_tokens)
    return DECODER_CONFIGS[family](arch, vocab_size, **special_tokens)


# model.moe's keys → (Megatron-Core's TransformerConfig field, the HF config keys that hold it: the first present wins;
# Qwen2/3-MoE and DeepSeek name the expert width moe_intermediate_size, Mixtral intermediate_size)
MOE_NAMES = {
    "num_experts": ("num_moe_experts", ("num_experts", "num_local_experts", "n_routed_experts")),
    "top_k": ("moe_router_topk", ("num_experts_per_tok",)),
    "expert_ffn_hidden_size": ("moe_ffn_hidden_size", ("moe_intermediate_size", "intermediate_size")),
    "shared_expert_ffn_hidden_size": ("moe_shared_expert_intermediate_size", ("shared_expert_intermediate_size",)),
    "aux_loss_coef": ("moe_aux_loss_coeff", ("router_aux_loss_coef",)),
}


def moe_of_hf_config(config: dict) -> dict | None:
    """model.moe's values read from an HF config.json (None: a dense model)."""
    found = {key: next((config[k] for k in hf_keys if config.get(k) is not None), None)
             for key, (_, hf_keys) in MOE_NAMES.items()}
    if not found["num_experts"]:
        return None
    return {k: v for k, v in found.items() if v is not None}


def safetensors_files(root: Path) -> list[Path]:
    return sorted(Path(root).glob("*.safetensors"))


MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on a header


class HeaderError(Refused):
    """A safetensors file whose header cannot be what a writer made."""


def read_header(path: Path) -> dict:
    """The safetensors JSON header (tensor names, dtypes, shapes, offsets; `__metadata__`) without reading tensors.
    HeaderError when the file cannot hold the header it announces (a crafted length would ask for exabytes) or the
    header is not a JSON object in UTF-8."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        if len(first) < 8:
            raise HeaderError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", first)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise HeaderError(f"{path}: its header claims {n} bytes (the file has {size}, the limit is "
                             f"{MAX_HEADER_BYTES})")
        try:
            header = json.loads(f.read(n))
        except RecursionError:  # nesting deeper than the parser goes: not a header any writer makes
            raise HeaderError(f"{path}: its header nests too deep") from None
        except ValueError as e:  # json.JSONDecodeError, or UnicodeDecodeError from json.loads's detect_encoding
            raise HeaderError(f"{path}: its header is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: its header is not a JSON object")
    return header


def tensor_shapes(root: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for f in safetensors_files(root):
        for name, info in read_header(f).items():
            if name != "__metadata__":
                out[name] = (info["dtype"], info["shape"])
    return out


def parameter_count(root: Path) -> int:
    total = 0
    for _, shape in tensor_shapes(root).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def dominant_dtype(root: Path) -> str | None:
    counts: dict[str, int] = {}
    for dtype, _ in tensor_shapes(root).values():
        counts[dtype] = counts.get(dtype, 0) + 1
    names = {code: name for name, code in DTYPE_CODES.items() if name in ("float32", "bfloat16", "float16")}
    return names.get(max(counts, key=counts.get)) if counts else None


def iter_tensors(root: Path) -> Iterator[tuple[str, "object"]]:
    """(name, tensor) one at a time, memory mapped, across all shards."""
    from safetensors import safe_open

    for f in safetensors_files(root):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


class TensorReader:
    """Every shard opened once (memory mapped): `names`, and `reader(name)` → that tensor."""

    def __init__(self, root: Path):
        self.root, self._open, self._where = Path(root), [], {}

    def __enter__(self) -> "TensorReader":
        from safetensors import safe_open

        for f in safetensors_files(self.root):
            st = safe_open(str(f), framework="pt")
            self._open.append(st)
            self._where.update(dict.fromkeys(st.keys(), st))
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()
        self._where.clear()

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __call__(self, name: str):
        return self._where[name].get_tensor(name)


def load_state_dict(root: Path) -> dict:
    return dict(iter_tensors(root))


def copy_tokenizer(src: Path, dst: Path, chat_template: Path | None = None) -> list[str]:
    """Copy the tokenizer files, chat template included; returns what was copied. `chat_template`: a template file
    that becomes dst's chat_template.jinja when src has none (the run's `model.chat_template`)."""
    copied = []
    Path(dst).mkdir(parents=True, exist_ok=True)
    for name in mf.TOKENIZER_FILES:
        if os.path.lexists(Path(src) / name):
            folder.copy_file(Path(src) / name, Path(dst) / name)  # a symlink there is refused, never followed
            copied.append(name)
    if chat_template is not None and not mf.chat_template_present(Path(dst)):
        shutil.copy2(chat_template, Path(dst) / "chat_template.jinja")
        copied.append("chat_template.jinja")
    return copied


def write_config_and_generation(root: Path, config) -> None:
    """config.json (naming the architecture: servers refuse configs without it) and generation_config.json."""
    from transformers import GenerationConfig

    if not getattr(config, "architectures", None):
        config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(root))
    GenerationConfig.from_model_config(config).save_pretrained(str(root))
