"""The local layer spec's RMSNorm under sequence parallel. Part of the pretrain worker program.

Megatron trains a mixture of experts under tensor parallel only with sequence parallel, and its torch norm wrapper
(`WrappedTorchNorm`, the local spec's) refuses sequence parallel outright: with it each TP rank normalises its own
slice of the sequence, so a norm weight's gradient holds only that slice's part. Megatron sums such gradients over
the TP ranks at the end of a step (`finalize_model_grads`) for every parameter marked `sequence_parallel`, as
Transformer Engine's norms are; this norm is torch's RMSNorm with that mark, nothing else."""
from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class SequenceParallelRMSNorm:
    """torch.nn.RMSNorm whose weight is marked for the TP sum of its gradient when the config is sequence parallel
    (the build_module signature of Megatron's norm classes)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def with_sequence_parallel_norms(spec, layers: int):
    """The local layer spec as a block of `layers` layers whose input, pre-MLP and final norms are the marked RMSNorm
    (q/k norms stay: Megatron sums their gradients over TP by name)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec.submodules.input_layernorm = SequenceParallelRMSNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelRMSNorm)
