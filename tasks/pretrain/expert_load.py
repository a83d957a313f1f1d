"""Tokens each MoE layer's router sends to each expert: counted from the routers' own routing maps by a forward hook,
summed over every rank once per step. Part of the pretrain worker program (imported by worker.py).

Megatron-Core keeps such counts itself only with expert bias on (`TopKRouter.local_tokens_per_expert`), which changes
the routing; a hook reads the same `routing_map` ([tokens, experts], True where a token goes) and changes nothing.
Like Megatron's own count, only training forward passes count: not evaluation (eval mode) and, under full recompute,
not both passes (Megatron's checkpointed forward runs without grad, the recompute with it)."""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter


class ExpertLoad:
    def __init__(self, chunks: list, num_layers: int, num_experts: int):
        self.step = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.routers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            router.register_forward_hook(self.count)

    def count(self, router, inputs, output) -> None:
        if router.training and torch.is_grad_enabled():
            _, routing_map = output
            self.step[router.layer_number - 1] += routing_map.sum(dim=0).to("cpu", torch.float64)

    def take_step(self, sum_over_ranks) -> list[list[float]]:
        """This step's counts, [layer][expert], summed over every rank (a collective: every rank calls), then reset.
        Each rank's routers saw its own tokens (data-parallel micro batches, sequence-parallel shards) of the layers
        its pipeline stage holds, so the sum over ranks counts every routed token once."""
        layers, experts = self.step.shape
        flat = sum_over_ranks(self.step.reshape(-1).tolist())
        self.step.zero_()
        return [flat[i * experts:(i + 1) * experts] for i in range(layers)]


def imbalance(counts: list[list[float]]) -> float:
    """The busiest expert's tokens over the mean, in the worst layer: 1.0 is an even spread, E all to one expert."""
    return max(max(layer) / (sum(layer) / len(layer)) for layer in counts if sum(layer) > 0)


def add(total: list[list[float]] | None, counts: list[list[float]]) -> list[list[float]]:
    if total is None:
        return [list(layer) for layer in counts]
    return [[a + b for a, b in zip(t, c)] for t, c in zip(total, counts)]
