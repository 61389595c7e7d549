"""Vocabulary-parallel primitives for the objective: gathered logits and gathered log-softmax.

Both work on logits whose vocabulary dimension may be split over the ranks of a tensor-parallel
process group (rank r holds the columns [r * V_local, (r + 1) * V_local), the Megatron layout), and
both are custom autograd functions for two reasons:

- memory: the loss only ever needs a handful of columns per row (the sampled token and its K
  candidates) plus the row's log-normaliser. Plain autograd would keep a [T, V] log-softmax alive
  for the backward pass; here only the normaliser lse [T] is kept and the softmax is recomputed
  chunk by chunk in backward, written straight into the gradient buffer.
- tensor parallelism: `torch.distributed.all_reduce` is not differentiable. The loss is computed
  identically on every rank (all reduced quantities are replicated), so the gradient for a rank's
  shard is local: d/dz_u of log p(v) = 1[u = v] - p(u), with p(u) = exp(z_u - lse) known locally once
  lse is global. No collective is needed in backward.

Ids are GLOBAL vocabulary ids and must be valid (0 <= id < V); callers replace padding by 0 and mask
the result themselves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions run in float64 for float64 logits (the property tests) and float32 otherwise (bf16
    logits are upcast one chunk at a time, never as a whole)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_reduce_(tensor: Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _local_columns(ids: Tensor, vocab_start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """Map global ids [T, M] to (column in this shard, safe for gather [T, M]; in-shard mask [T, M])."""
    local_ids = ids - vocab_start
    in_shard = (local_ids >= 0) & (local_ids < local_vocab)
    return torch.where(in_shard, local_ids, 0), in_shard


def _gather_global(
    logits_shard: Tensor, local_ids: Tensor, in_shard: Tensor, group: dist.ProcessGroup | None
) -> Tensor:
    """z at the requested ids [T, M], in the compute dtype, identical on every rank."""
    z_ids = logits_shard.gather(1, local_ids).to(compute_dtype(logits_shard.dtype))
    # Every id lives in exactly one shard: zero the others' contributions, then SUM over ranks.
    z_ids = torch.where(in_shard, z_ids, 0.0)
    return _all_reduce_(z_ids, dist.ReduceOp.SUM, group)


class _GatherLogits(torch.autograd.Function):
    """z[t, ids[t, m]] for a vocabulary-sharded z; gradient scattered back into the local shard."""

    @staticmethod
    def forward(ctx, logits_shard: Tensor, ids: Tensor, vocab_start: int, group) -> Tensor:
        local_ids, in_shard = _local_columns(ids, vocab_start, logits_shard.shape[1])
        ctx.save_for_backward(local_ids, in_shard)
        ctx.logits_shape, ctx.logits_dtype = logits_shard.shape, logits_shard.dtype
        return _gather_global(logits_shard, local_ids, in_shard, group)

    @staticmethod
    def backward(ctx, grad_z_ids: Tensor):
        local_ids, in_shard = ctx.saved_tensors
        grad_logits = torch.zeros(ctx.logits_shape, dtype=ctx.logits_dtype, device=grad_z_ids.device)
        grad_in_shard = torch.where(in_shard, grad_z_ids, 0.0).to(ctx.logits_dtype)
        grad_logits.scatter_add_(1, local_ids, grad_in_shard)
        return grad_logits, None, None, None


def gather_logits(
    logits_shard: Tensor, ids: Tensor, vocab_start: int = 0, group: dist.ProcessGroup | None = None
) -> Tensor:
    """Differentiable z at global `ids` [T, M] from logits [T, V_local]; result [T, M] in the
    compute dtype, replicated over the group. Memory: O(T * M) forward, the [T, V_local] gradient in
    backward (which any loss on these logits needs anyway)."""
    return _GatherLogits.apply(logits_shard, ids, vocab_start, group)


def _chunk_normaliser(z_chunk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For rows z [c, V]: (row max m, S = sum exp(z - m), X = sum exp(z - m) * (z - m)), all [c].

    Built on torch.softmax, whose fused CPU/GPU kernel is several times faster than separate
    max / sub / exp / sum passes: with p = softmax(z), p(argmax) = 1 / S, so S = 1 / max(p), and
    X = S * (sum p z - m). X gives the entropy without another pass: H = log S - X / S.
    Rows that are all -inf get m = -max_float and S = X = 0, so every later combination stays finite."""
    row_max = z_chunk.amax(dim=1)
    probs = torch.softmax(z_chunk, dim=1)  # [c, V] temporary, bounded by the chunk
    sum_exp = probs.amax(dim=1).reciprocal()
    mean_logit = (probs * z_chunk).sum(dim=1)  # sum_v p_v z_v
    masked = torch.isnan(mean_logit) & torch.isfinite(row_max)
    if bool(masked.any()):  # -inf logits (masked vocabulary padding): 0 * -inf -> NaN; drop those terms
        rows_p, rows_z = probs[masked], z_chunk[masked]
        mean_logit[masked] = (rows_p * torch.where(rows_p > 0, rows_z, 0.0)).sum(dim=1)
    sum_exp_shifted = sum_exp * (mean_logit - row_max)
    empty = row_max == float("-inf")
    if bool(empty.any()):
        row_max = torch.where(empty, torch.finfo(z_chunk.dtype).min, row_max)
        sum_exp = torch.where(empty, 0.0, sum_exp)
        sum_exp_shifted = torch.where(empty, 0.0, sum_exp_shifted)
    return row_max, sum_exp, sum_exp_shifted


def log_normaliser(
    logits_shard: Tensor, group: dist.ProcessGroup | None, chunk_tokens: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(lse [T], entropy [T], local_lse [T]) of softmax over the FULL (all shards) vocabulary, no
    gradient; local_lse is this shard's own log-normaliser (equal to lse without a group).

    Processes `chunk_tokens` rows at a time so extra memory is O(chunk_tokens * V_local). Across
    ranks: MAX of the row maxima, then SUM of the rescaled sums (one all-reduce each)."""
    num_tokens = logits_shard.shape[0]
    dtype = compute_dtype(logits_shard.dtype)
    row_max = torch.empty(num_tokens, dtype=dtype, device=logits_shard.device)
    sum_exp = torch.empty_like(row_max)
    sum_exp_shifted = torch.empty_like(row_max)
    with torch.no_grad():
        for start in range(0, num_tokens, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            z_chunk = logits_shard[rows].to(dtype)
            row_max[rows], sum_exp[rows], sum_exp_shifted[rows] = _chunk_normaliser(z_chunk)
        local_lse = row_max + sum_exp.log()
        if group is not None:
            global_max = _all_reduce_(row_max.clone(), dist.ReduceOp.MAX, group)
            scale = (row_max - global_max).exp()  # [T] this shard's share, exp(m_r - M)
            # S = sum_r k_r S_r;  X = sum_r k_r (X_r + (m_r - M) S_r), relative to the global max M.
            sums = torch.stack(
                [scale * sum_exp, scale * (sum_exp_shifted + (row_max - global_max) * sum_exp)]
            )
            _all_reduce_(sums, dist.ReduceOp.SUM, group)
            row_max, (sum_exp, sum_exp_shifted) = global_max, sums
        lse = row_max + sum_exp.log()
        entropy = sum_exp.log() - sum_exp_shifted / sum_exp
    return lse, entropy, local_lse


class _LogSoftmaxAt(torch.autograd.Function):
    """log p(ids) = z_ids - lse for a vocabulary-sharded z, with the softmax recomputed in backward."""

    @staticmethod
    def forward(ctx, logits_shard: Tensor, ids: Tensor, vocab_start: int, group, chunk_tokens: int):
        local_ids, in_shard = _local_columns(ids, vocab_start, logits_shard.shape[1])
        z_ids = _gather_global(logits_shard, local_ids, in_shard, group)  # [T, M]
        lse, entropy, local_lse = log_normaliser(logits_shard, group, chunk_tokens)  # [T] each
        ctx.save_for_backward(logits_shard, local_ids, in_shard, lse, local_lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(lse, entropy)
        return z_ids - lse[:, None], lse, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_lse, _grad_entropy):
        logits_shard, local_ids, in_shard, lse, local_lse = ctx.saved_tensors
        # d/dz_u sum_m g_m log p(v_m) = sum_m g_m 1[u = v_m] - (sum_m g_m) p(u), and the global
        # p(u) = softmax_local(z)_u * exp(local_lse - lse): the fused local softmax, rescaled per row.
        row_coef = -grad_logp.sum(dim=1) * (local_lse - lse).exp()  # [T]
        grad_logits = torch.empty_like(logits_shard)  # every element is written below
        dtype = compute_dtype(logits_shard.dtype)
        for start in range(0, logits_shard.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            if logits_shard.dtype == dtype:  # softmax straight into the output buffer: no temporary
                torch.softmax(logits_shard[rows], dim=1, out=grad_logits[rows]).mul_(row_coef[rows, None])
            else:  # low-precision logits: softmax in the compute dtype, one chunk at a time
                grad_logits[rows] = torch.softmax(logits_shard[rows].to(dtype), dim=1).mul_(
                    row_coef[rows, None]
                )
        grad_logits.scatter_add_(1, local_ids, torch.where(in_shard, grad_logp, 0.0).to(grad_logits.dtype))
        # Rows whose normaliser is not finite (NaN/inf trainer logits) are excluded by the caller, and
        # rows that are all -inf in this shard have p = 0 here; the softmax of either is NaN, so clear
        # them explicitly (their true gradient in this shard is 0).
        bad_rows = ~torch.isfinite(lse) | (local_lse == float("-inf"))
        if bool(bad_rows.any()):
            grad_logits[bad_rows] = 0.0
        return grad_logits, None, None, None, None


def log_softmax_at(
    logits_shard: Tensor,
    ids: Tensor,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    chunk_tokens: int = 32,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p at global `ids` [T, M] (differentiable), lse [T], entropy of p [T]) for softmax over
    the full vocabulary of logits [T, V_local] sharded over `group`. Extra memory beyond the
    [T, V_local] gradient: O(chunk_tokens * V_local + T * M)."""
    return _LogSoftmaxAt.apply(logits_shard, ids, vocab_start, group, chunk_tokens)
