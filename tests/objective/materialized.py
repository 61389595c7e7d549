"""Today's (before issue 28) objective path on MATERIALISED logits [T, V] (or a vocabulary shard of
them), kept as the reference the fused lm_head + objective (trainer/vocab_parallel.py
`fused_log_softmax_at`, trainer/objective.py `policy_loss`) is tested against, and the path the exact
property tests run the objective's own math on. Production never calls it.

`materialized_policy_loss(logits, batch, config, process_group)` is trainer/objective.py's loss with
the trainer log-probabilities taken from the logits: `log_softmax_at` (the chunked normaliser, the
softmax recomputed in backward) or, under replay, `gather_logits`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlfleet.trainer import objective
from rlfleet.trainer.objective import LossOutput, ObjectiveConfig, TokenBatch
from rlfleet.trainer.vocab_parallel import _all_reduce_, _chunk_normaliser, _local_columns, compute_dtype


def _gather_global(
    logits_shard: Tensor, local_ids: Tensor, in_shard: Tensor, group: dist.ProcessGroup | None
) -> Tensor:
    """z at the requested ids [T, M], in the compute dtype, identical on every rank."""
    z_ids = logits_shard.gather(1, local_ids).to(compute_dtype(logits_shard.dtype))
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


def materialized_policy_loss(
    logits: Tensor, batch: TokenBatch, config: ObjectiveConfig, process_group: dist.ProcessGroup | None = None
) -> LossOutput:
    """The corrected policy loss of trainer/objective.py on logits [T, V] (or [T, V / tp] with
    `process_group`), already divided by the temperature."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be floating point [T, V], got {logits.dtype} {tuple(logits.shape)}")
    world = dist.get_world_size(process_group) if process_group is not None else 1
    rank = dist.get_rank(process_group) if process_group is not None else 0
    local_vocab = logits.shape[1]

    def project(ids: Tensor, normalise: bool) -> tuple[Tensor, Tensor, Tensor]:
        if normalise:
            return log_softmax_at(logits, ids, rank * local_vocab, process_group, config.chunk_tokens)
        empty = torch.zeros(0)
        return gather_logits(logits, ids, rank * local_vocab, process_group), empty, empty

    return objective.corrected_loss(
        project, logits.shape[0], world * local_vocab, compute_dtype(logits.dtype), batch, config
    )
