"""Packed micro-batches for the `megatron` backend: megatron-core's THD layout (one row of sequences
back to back, `PackedSeqParams` with their cumulative lengths) on every layer spec.

TransformerEngine's attention takes THD natively. megatron-core 0.19.2's local (pure PyTorch) core
attention, the CPU tier's, asserts `packed_seq_params is None`; `PackedDotProductAttention` takes its
place in the local spec: for a packed row it runs trainer/backends/attention.py's per-sequence causal
attention (the sequences from `cu_seqlens_q`), anything else goes to megatron's own DotProductAttention.
Rotary embeddings of a packed row restart at each sequence in megatron's own code (`apply_rotary_pos_emb`
with `cu_seqlens`), as TE's do. Imported by trainer/backends/backend_megatron.py where megatron-core is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from rlfleet.trainer.backends.attention import causal_attention_per_sequence


class PackedDotProductAttention(DotProductAttention):
    """megatron's local core attention, plus the THD layout: query [T, heads, D], key and value [T,
    query groups, D] of this TP rank (T: the packed row's tokens, every rank's whole row: sequence
    parallelism gathers the row before attention) -> [T, heads * D]."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise ValueError("PackedDotProductAttention takes the THD layout without an attention bias")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds[-1] != query.shape[0] or packed_seq_params.cu_seqlens_kv.tolist() != bounds:
            raise ValueError(f"cu_seqlens {bounds} do not describe the packed row of {query.shape[0]} tokens")
        sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # [T, h, D] -> [1, h, T, D]
        q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
        out = causal_attention_per_sequence(q, k, v, sizes, self.softmax_scale, dropout_p)[0]  # [h, T, D]
        return out.transpose(0, 1).reshape(query.shape[0], -1)


def packed_seq_params(lengths: list[int], device: torch.device) -> PackedSeqParams:
    """The THD description of a packed row of sequences of `lengths` tokens (int32 cumulative lengths,
    as TransformerEngine wants them)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    cu = cu.to(device)
    longest = max(lengths)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )
