"""Megatron-Core's local core attention computed by torch's scaled_dot_product_attention. The local layer spec's
DotProductAttention materialises the [batch × heads, seq, seq] scores and runs the softmax unfused: at sequence 2048
on a GPU that is most of a layer's memory traffic (the first H200 run measured 15% MFU). SDPA picks flash or
memory-efficient kernels on GPUs and the plain maths on CPU, with the same result. Part of the pretrain worker
program: imported by mcore_model.py after the CUDA→CPU shim."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    """Same parameters, checkpoint keys and maths as DotProductAttention (it inherits them); only the forward's
    kernel differs. What SDPA cannot express here (attention dropout through Megatron's RNG tracker, an explicit
    mask, a softmax offset, query-key layer scaling, a sliding window) goes to Megatron's own forward."""

    def _sdpa_applies(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (attention_mask is None and attention_bias is None and packed_seq_params is None
                and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal and dropout == 0.0
                and self.softmax_offset is None and not self.config.apply_query_key_layer_scaling
                and self.config.window_size is None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # Megatron's [seq, batch, heads, head_dim] → SDPA's [batch, heads, seq, head_dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        native_gqa = repeats > 1 and (not q.is_cuda or q.dtype in (torch.bfloat16, torch.float16))
        if repeats > 1 and not native_gqa:
            # on a GPU only the flash kernel (half precision) takes grouped K/V; the others need them repeated
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=native_gqa)
        # → [seq, batch, heads × head_dim], what the output projection takes
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), self.hidden_size_per_partition)
