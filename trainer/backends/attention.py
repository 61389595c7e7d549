"""Attention over a packed row that computes only the pairs within each sequence.

The transformers backend forwards a micro-batch as ONE row of sequences back to back, the position ids
restarting at 0 at each (trainer/rollout/batching.py). Left to transformers' `sdpa`, that row gets a dense
[L, L] block-causal mask: every pair of the L positions is scored, then masked, so a 13K-token row of
64 short sequences costs (and holds, for the scores) L^2 although only sum(n_i^2 / 2) pairs count
(docs/benchmarks.md "One train step"). `varlen_sdpa_attention` is the variable-length path flash
attention takes on a GPU, written with torch's own `scaled_dot_product_attention`: one causal call per
sequence (the sequences found where the position ids restart, as transformers finds them for flash
attention), on CPU and GPU alike, no extra package. It is registered in transformers' AttentionInterface
under `VARLEN_SDPA` and has no mask function, so transformers builds no [L, L] mask for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VARLEN_SDPA = "rlfleet_varlen_sdpa"


def sequence_bounds(position_ids: torch.Tensor) -> list[int]:
    """[0, s_1, ..., L]: where each packed sequence starts (position id 0), then the row's length.
    `position_ids` [1, L] or [L]; a row that does not start at 0 is one sequence that continues."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat[1:] == 0).reshape(-1) + 1
    return [0, *starts.tolist(), int(flat.numel())]


def causal_attention_per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sizes: list[int],
    scale: float | None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """query [1, heads, L, D], key and value [1, kv_heads, L, D] of a row of sequences of `sizes` tokens
    back to back -> [1, heads, L, D]: causal attention within each sequence, nothing across them
    (grouped-query heads repeated here); a sliding window also bounds how far back a token sees. The
    one per-sequence loop of both backends (this module's transformers attention function, and
    trainer/backends/megatron_packed.py's core attention for megatron's THD layout)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    parts = []
    # split, not a slice per sequence: a slice's backward writes into a zero tensor of the whole row
    # (L x sequences of work); split's backward is one concatenation
    for n, q, k, v in zip(
        sizes, query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2), strict=True
    ):
        if sliding_window is not None and n > sliding_window:
            i = torch.arange(n, device=query.device)
            seen = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window)
            parts.append(
                F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=dropout_p, scale=scale)
            )
        else:
            parts.append(
                F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale)
            )
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query [1, heads, L, D], key and value [1, kv_heads, L,
    D] (grouped-query heads are repeated here), `position_ids` [1, L] of the packed row; returns
    [1, L, heads, D] as transformers' sdpa does. Causal within each sequence, nothing across them; a
    sliding window (a layer that has one) also bounds how far back a token sees."""
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN_SDPA} takes packed rows without an attention mask (got one of {tuple(attention_mask.shape)})"
        )
    if query.shape[0] != 1:
        raise ValueError(f"{VARLEN_SDPA} takes one packed row, got a batch of {query.shape[0]}")
    length = query.shape[2]
    bounds = sequence_bounds(position_ids) if position_ids is not None else [0, length]
    if bounds[-1] != length:
        raise ValueError(f"{VARLEN_SDPA}: position ids cover {bounds[-1]} positions, the row has {length}")
    sizes = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    dropout_p = dropout if module.training else 0.0
    out = causal_attention_per_sequence(query, key, value, sizes, scaling, dropout_p, sliding_window)
    return out.transpose(1, 2).contiguous(), None


def use_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch a transformers model to `varlen_sdpa_attention` (registered on first use). False, and the
    model unchanged (its own attention, with transformers' block-causal mask), for a model whose
    attention does not go through transformers' AttentionInterface."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    set_implementation = getattr(model, "set_attn_implementation", None)
    if set_implementation is None:
        return False
    set_implementation(VARLEN_SDPA)
    return getattr(model.config, "_attn_implementation", None) == VARLEN_SDPA
