"""Quantized checkpoints for vLLM (compressed-tensors, written by llm-compressor in the llmcompressor runtime): the
export types, what a folder's config.json says its scheme is, and the gate a written folder must pass before it is
published (docs/export.md). The held-out losses are measured by the worker (it alone can read compressed-tensors);
the gate judges them against the bound and checks the written config and weights itself."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from conversions.checks import check, report
from conversions.refusal import Refused

WEIGHTS_GLOB = "*.safetensors"


class QuantError(Refused):
    pass


@dataclass(frozen=True)
class QuantType:
    """One export type: llm-compressor's preset scheme and the gate's bound on the held-out loss increase (nats per
    token over the unquantized source, measured on rows the calibration never saw)."""

    preset: str
    max_loss_delta: float
    group_size: int | None = None  # the preset's weight groups along a Linear's input width (None: per channel)


TYPES = {"w8a8": QuantType("W8A8", max_loss_delta=0.05),
         "w4a16": QuantType("W4A16", max_loss_delta=0.25, group_size=128)}
CALIBRATION_ROWS = 64  # and as many held-out rows
MAX_SEQ_LENGTH = 128


def quant_type(name: str) -> QuantType:
    if name in TYPES:
        return TYPES[name]
    raise QuantError(f"--type {name}: not a quantization type (known: {', '.join(TYPES)})")


def group_problem(type_name: str, widths: dict[str, int], key: str = "--type") -> str | None:
    """Why a grouped scheme cannot quantize a model whose Linear input widths are `widths` (named as the caller's
    reader knows them: config.json's or the model section's keys): its group does not divide one. The message names
    `key` (the flag or config key that asked for the type) and those widths; None when it can. llm-compressor 0.14
    refuses such a model itself, but only inside the worker, after the model is loaded and the source's held-out loss
    measured, with a traceback (a ValueError listing each `down_proj (columns=344, group_size=128)`)."""
    group = quant_type(type_name).group_size
    odd = {k: v for k, v in widths.items() if group and v % group}
    if not odd:
        return None
    listed = ", ".join(f"{k} {v}" for k, v in odd.items())
    return (f"{key} {type_name}: {quant_type(type_name).preset} quantizes weights in groups of {group} input columns, "
            f"which do not divide this model's {listed}; export w8a8 (per channel) or a model whose widths are "
            "multiples of the group")


def input_widths(config: dict) -> dict[str, int]:
    """The input widths of a Llama-family decoder's Linear layers (q/k/v/gate/up read hidden_size, o the heads'
    width, down intermediate_size), from config.json."""
    return {k: v for k, v in linear_widths(config).items() if k != "num_key_value_heads x head_dim"}


def refuse_shapes(type_name: str, config: dict) -> None:
    """QuantError (group_problem) before anything runs."""
    if problem := group_problem(type_name, input_widths(config)):
        raise QuantError(problem)


def scheme_of(config: dict) -> str | None:
    """The scheme a config.json's compressed-tensors quantization_config describes, named as llm-compressor's presets
    are (W8A8, W4A16, W4A16_ASYM, FP8, ...); None for a checkpoint without quantization_config. A config group
    baton cannot name is `compressed-tensors <its weight/activation description>`."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    if q.get("quant_method") != "compressed-tensors":
        return f"{q.get('quant_method')}"
    names = sorted({_group_scheme(g) for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)})
    return "+".join(names) or "compressed-tensors (no config_groups)"


def _group_scheme(group: dict) -> str:
    w, a = group.get("weights") or {}, group.get("input_activations") or None
    bits, kind, sym = w.get("num_bits"), w.get("type"), w.get("symmetric", True)
    if kind == "float" and bits == 8:
        return "FP8" if a else "FP8_W8A16"
    if kind == "int" and bits == 8 and a and a.get("type") == "int" and a.get("num_bits") == 8:
        return "W8A8"
    if kind == "int" and bits in (4, 8) and a is None:
        return f"W{bits}A16" + ("" if sym else "_ASYM")
    act = f"a{a.get('type')}{a.get('num_bits')}" if a else "a16"
    return f"compressed-tensors w{kind}{bits}/{act}"


def linear_widths(config: dict) -> dict[str, int]:
    """The in/out widths of a Llama-family decoder's Linear layers, from config.json (the shapes vLLM's kernels see)."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    kv = config.get("num_key_value_heads") or heads
    out = {"hidden_size": hidden, "intermediate_size": config.get("intermediate_size"),
           "num_attention_heads x head_dim": heads * head_dim if heads and head_dim else None,
           "num_key_value_heads x head_dim": kv * head_dim if kv and head_dim else None}
    return {k: v for k, v in out.items() if isinstance(v, int)}


def decoder_linears(config: dict) -> int:
    """A Llama-family decoder's quantized Linear layers: q, k, v, o, gate, up, down in every layer (lm_head kept)."""
    return 7 * int(config.get("num_hidden_layers") or 0)


def gate(folder: Path, src: Path, type_name: str, measured: dict, max_loss_delta: float | None = None) -> dict:
    """verify.report of the written folder against its source: the config names the asked scheme and keeps lm_head
    unquantized, every decoder Linear has quantized weights, and the held-out loss (measured: heldout_loss_source,
    heldout_loss, quantized_modules: the worker's QuantizeResult) is within the bound of the source's (either way: a
    quantized model that scores better on 64 rows has still moved)."""
    kind = quant_type(type_name)
    if max_loss_delta is not None:
        kind = dataclasses.replace(kind, max_loss_delta=max_loss_delta)
    config = json.loads((folder / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    checks = [_scheme_check(config, kind), _coverage_check(source, measured["quantized_modules"]),
              _loss_check(measured, kind.max_loss_delta)]
    return report(checks)


def _scheme_check(config: dict, kind: QuantType) -> dict:
    scheme = scheme_of(config)
    ignored = (config.get("quantization_config") or {}).get("ignore") or []
    ok = scheme == kind.preset and "lm_head" in ignored
    return check("quant.scheme", ok, f"config.json quantization_config: {scheme} (asked {kind.preset}), ignore "
                                     f"{ignored}")


def _coverage_check(source: dict, quantized: int) -> dict:
    expected = decoder_linears(source)
    return check("quant.coverage", quantized == expected,
                 f"{quantized} Linear layers with quantized weights ({expected} expected: 7 per decoder layer)")


def _loss_check(measured: dict, bound: float) -> dict:
    before, after = measured["heldout_loss_source"], measured["heldout_loss"]
    delta = after - before
    return {**check("quant.heldout_loss", abs(delta) <= bound,
                    f"held-out loss {after:.5f} vs the source's {before:.5f} nats/token: {delta:+.2e} (bound "
                    f"±{bound})"), "loss_delta": delta, "bound": bound}

