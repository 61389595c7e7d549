"""The fused lm_head + vocabulary-parallel log-softmax of the objective: log-probabilities of a few
ids per row computed from the final hidden states and the output embedding, never holding the
logits [T, V].

`fused_log_softmax_at(hidden [T, H], weight [V_local, H], ids [T, M], ...)`: the logits are made
tile by tile (`chunk_tokens` rows x `chunk_vocab` columns, hidden @ weight_tile.T / temperature) in
forward, where each tile adds to the row's online log-sum-exp and entropy statistics and gives up
the logits at the requested ids; backward makes every tile again and turns it into the gradients
of both inputs straight away (d hidden += dz @ W_tile, d W_tile += dz.T @ hidden), so the extra
memory is O(tile + T * M) besides the weight's gradient, which any trainer holds anyway.

Tensor parallel: the vocabulary dimension of the weight may be split over the ranks of a process
group (rank r holds rows [r * V_local, (r + 1) * V_local), the Megatron layout), the hidden states
replicated. The log-normaliser combines the shards' statistics (one MAX and one SUM all-reduce) and
the gathered logits are summed over ranks (each id lives in one shard). The loss is then computed
identically on every rank, so each rank's weight gradient is its shard's, exact; the hidden
states' gradient is this shard's PARTIAL sum over its vocabulary: the caller reduces it over the
group (megatron's `copy_to_tensor_model_parallel_region` / sequence-parallel gather do in their
backward, as for the output layer they stand in for).

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


def _chunk_normaliser(z_chunk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For rows z [c, V]: (row max m, S = sum exp(z - m), X = sum exp(z - m) * (z - m)), all [c].

    Built on torch.softmax, whose fused CPU/GPU kernel is several times faster than separate
    max / sub / exp / sum passes: with p = softmax(z), p(argmax) = 1 / S, so S = 1 / max(p), and
    X = S * (sum p z - m). X gives the entropy without another pass: H = log S - X / S.
    Rows that are all -inf get m = -max_float and S = X = 0, so every later combination stays finite."""
    row_max = z_chunk.amax(dim=1)
    probs = torch.softmax(z_chunk, dim=1)  # [c, V] temporary, bounded by the chunk
    sum_exp = probs.amax(dim=1).reciprocal()
    # sum_v p_v z_v as c dot products (batched matmul): no second [c, V] temporary
    mean_logit = torch.bmm(probs.unsqueeze(1), z_chunk.unsqueeze(2)).reshape(-1)
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


def _combine(
    left: tuple[Tensor, Tensor, Tensor], right: tuple[Tensor, Tensor, Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """Two (row max m, S = sum exp(z - m), X = sum exp(z - m) (z - m)) over disjoint columns -> the
    union's, relative to the larger max M: S = sum_i k_i S_i, X = sum_i k_i (X_i + (m_i - M) S_i),
    k_i = exp(m_i - M)."""
    (m1, s1, x1), (m2, s2, x2) = left, right
    top = torch.maximum(m1, m2)
    k1, k2 = (m1 - top).exp(), (m2 - top).exp()
    return top, k1 * s1 + k2 * s2, k1 * (x1 + (m1 - top) * s1) + k2 * (x2 + (m2 - top) * s2)


def _global_normaliser(
    stats: tuple[Tensor, Tensor, Tensor], group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(row max M [T], S = sum exp(z - M) [T], entropy [T]) of the softmax over every shard's columns
    from this shard's statistics; lse = M + log S."""
    row_max, sum_exp, sum_exp_shifted = stats
    if group is not None:
        global_max = _all_reduce_(row_max.clone(), dist.ReduceOp.MAX, group)
        scale = (row_max - global_max).exp()  # [T] this shard's share, exp(m_r - M)
        sums = torch.stack([scale * sum_exp, scale * (sum_exp_shifted + (row_max - global_max) * sum_exp)])
        _all_reduce_(sums, dist.ReduceOp.SUM, group)
        row_max, (sum_exp, sum_exp_shifted) = global_max, sums
    return row_max, sum_exp, sum_exp.log() - sum_exp_shifted / sum_exp


def _tiles(num_rows: int, num_cols: int, chunk_tokens: int, chunk_vocab: int):
    """(row slice, [(column start, column end), ...]) for every chunk of rows."""
    cols = [(v, min(v + chunk_vocab, num_cols)) for v in range(0, num_cols, chunk_vocab)]
    for start in range(0, num_rows, chunk_tokens):
        yield slice(start, start + chunk_tokens), cols


def _in_tile(local_ids: Tensor, in_shard: Tensor, lo: int, hi: int) -> tuple[Tensor, Tensor]:
    """(column inside the tile, safe for gather [c, M]; whether the id falls in the tile [c, M])."""
    hit = in_shard & (local_ids >= lo) & (local_ids < hi)
    return torch.where(hit, local_ids - lo, 0), hit


class _FusedLogSoftmaxAt(torch.autograd.Function):
    """log p(ids) (or, without `normalise`, the logits at ids) from hidden states and the output
    embedding, the logits made one tile at a time in forward and again in backward."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        ids: Tensor,
        vocab_start: int,
        group,
        temperature: float,
        chunk_tokens: int,
        chunk_vocab: int,
        normalise: bool,
    ):
        dtype = compute_dtype(hidden.dtype)
        num_rows, local_vocab = hidden.shape[0], weight.shape[0]
        local_ids, in_shard = _local_columns(ids, vocab_start, local_vocab)
        z_ids = torch.zeros(ids.shape, dtype=dtype, device=hidden.device)
        stats = [torch.empty(num_rows, dtype=dtype, device=hidden.device) for _ in range(3)]
        with torch.no_grad():
            for rows, cols in _tiles(num_rows, local_vocab, chunk_tokens, chunk_vocab):
                h = hidden[rows].to(dtype) / temperature  # z = h W^T / temperature, scaled on the [c, H] side
                acc = None
                for lo, hi in cols:
                    z = h @ weight[lo:hi].to(dtype).T  # [c, v]: the only logits that exist
                    column, hit = _in_tile(local_ids[rows], in_shard[rows], lo, hi)
                    z_ids[rows] += torch.where(hit, z.gather(1, column), 0.0)
                    if normalise:
                        tile = _chunk_normaliser(z)
                        acc = tile if acc is None else _combine(acc, tile)
                if acc is not None:
                    for buffer, value in zip(stats, acc, strict=True):
                        buffer[rows] = value
            _all_reduce_(z_ids, dist.ReduceOp.SUM, group)  # each id lives in exactly one shard
            if normalise:
                row_max, sum_exp, entropy = _global_normaliser((stats[0], stats[1], stats[2]), group)
                lse = row_max + sum_exp.log()
            else:
                lse = entropy = row_max = sum_exp = torch.zeros(num_rows, dtype=dtype, device=hidden.device)
        ctx.save_for_backward(hidden, weight, local_ids, in_shard, lse, row_max, sum_exp)
        ctx.config = (temperature, chunk_tokens, chunk_vocab, normalise)
        ctx.mark_non_differentiable(lse, entropy)
        return (z_ids - lse[:, None] if normalise else z_ids), lse, entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_lse, _grad_entropy):
        hidden, weight, local_ids, in_shard, lse, row_max, sum_exp = ctx.saved_tensors
        temperature, chunk_tokens, chunk_vocab, normalise = ctx.config
        dtype = compute_dtype(hidden.dtype)
        grad_out = grad_out.to(dtype)
        # d/dz_u sum_m g_m log p(v_m) = sum_m g_m 1[u = v_m] - (sum_m g_m) p(u); without the
        # normaliser only the first term. Rows whose normaliser is not finite (non-finite trainer
        # logits, excluded by the caller) get no softmax term.
        # p(u) = exp(z_u - M) / S, as torch.softmax forms it, not exp(z_u - lse): lse = M + log S carries
        # an absolute rounding error of eps |lse|, which exp turns into a relative error of p that grows
        # with the logits' size (and the row coefficient multiplies it: ~1e6 at the largest centering
        # ratio; tests/objective/test_objective_fused.py measures both forms against exact arithmetic).
        finite = torch.isfinite(lse)
        row_coef = torch.where(finite, -grad_out.sum(dim=1) / sum_exp, 0.0)  # -(sum_m g_m) / S
        safe_max = torch.where(finite, row_max, 0.0)
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        for rows, cols in _tiles(hidden.shape[0], weight.shape[0], chunk_tokens, chunk_vocab):
            h = hidden[rows].to(dtype)
            h_scaled = h / temperature
            for lo, hi in cols:
                column, hit = _in_tile(local_ids[rows], in_shard[rows], lo, hi)
                if not normalise and not bool(hit.any()):
                    continue  # replay: only the support's columns get a gradient
                w = weight[lo:hi].to(dtype)
                if normalise:  # the tile's logits again, turned into p - in place: one [c, v] buffer
                    grad_z = (h_scaled @ w.T).sub_(safe_max[rows, None]).exp_().mul_(row_coef[rows, None])
                else:
                    grad_z = torch.zeros((h.shape[0], hi - lo), dtype=dtype, device=h.device)
                grad_z.scatter_add_(1, column, torch.where(hit, grad_out[rows], 0.0))
                grad_z /= temperature  # z = h W^T / temperature
                grad_hidden[rows] += grad_z @ w
                grad_weight[lo:hi] += grad_z.T @ h
        return (
            grad_hidden.to(hidden.dtype),
            grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_log_softmax_at(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 512,
    chunk_vocab: int = 8192,
    normalise: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """(log p at global `ids` [T, M] (differentiable in `hidden` and `weight`), lse [T], entropy of p
    [T]) for p = softmax(hidden @ weight.T / temperature) over the full vocabulary, `weight` [V_local,
    H] the rows of this rank's vocabulary shard. Without `normalise`: the logits at `ids` (no
    normaliser, lse and entropy zeros): the replay path, where only those logits get a gradient.
    Reductions in float64 for float64 inputs, else float32. Extra memory: O(chunk_tokens *
    chunk_vocab + T * M) besides the gradients of the inputs."""
    return _FusedLogSoftmaxAt.apply(
        hidden, weight, ids, vocab_start, group, temperature, chunk_tokens, chunk_vocab, normalise
    )
