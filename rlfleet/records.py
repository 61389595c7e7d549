"""Token records: what a sampler produced, token-exact, as the trainer must score it.

This is the contract between the sampler side (which fills it from SGLang's `meta_info`), the rollout
(whose `Episode`, trainer/rollout/driver.py, keeps a multi-turn trajectory token-exact) and the objective
(which turns a batch into a `TokenBatch`).
Arrays are numpy so that the core and the operator never import torch.

Support sets are stored CSR-style: the support of output token i is
`support_ids[support_offsets[i]:support_offsets[i+1]]` (sorted by probability, descending) with the
matching `support_logprobs` (renormalised inside the support in `support` mode; a top-K head of the
full-vocabulary distribution in `head` mode).

Besides the record itself this module holds `validate_turn` (also `SampledTurn.validate`): per-token
checks; invalid tokens are flagged in `valid` and counted by reason in `invalid_reasons`, never
silently used and never raised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

# How the candidate sets of a turn relate to the sampler's distribution q.
SUPPORT_MODE = "support"  # candidates are the exact sampling support (top-k ∩ top-p); q sums to 1 on it
HEAD_MODE = "head"  # candidates are a top-K head of the full-vocabulary q (output_top_logprobs)
CANDIDATE_MODES = (SUPPORT_MODE, HEAD_MODE)

# Default tolerance on log-probabilities (|logsumexp| of a support, sampled-vs-support agreement).
# SGLang computes them in fp32 on GPU; 1e-3 nats is far above fp32 noise and far below any real defect.
LOGPROB_TOL = 1e-3

# Reasons a token is flagged invalid (keys of `invalid_reasons`).
R_MALFORMED = "malformed_record"  # array lengths / CSR pointers inconsistent: the whole turn is unusable
R_BAD_TOKEN = "token_id_out_of_range"
R_BAD_LOGPROB = "logprob_not_finite_or_positive"
R_BAD_VERSION = "weight_version_negative"
R_EMPTY_SUPPORT = "support_empty"
R_SUPPORT_NONFINITE = "support_logprob_not_finite_or_positive"
R_NOT_IN_SUPPORT = "sampled_token_not_in_support"
R_NOT_NORMALISED = "support_logprobs_not_normalised"
R_HEAD_MASS = "head_mass_above_one"
R_UNSORTED = "support_not_sorted_desc"
R_SAMPLED_MISMATCH = "sampled_logprob_disagrees_with_support"
R_SAMPLED_NONFINITE = "sampled_logprob_missing"
R_RENORM_BELOW_FULL = "renormalised_logprob_below_full_vocab"
# The trainer's per-step metric of the tokens failing one reason's check: `invalid_reason_<reason>`, per group
# and for the fleet (trainer/metrics.py `invalid_token_metrics`; the operator reads it, rebalancer.py).
INVALID_METRIC_PREFIX = "invalid_reason_"


@dataclass
class SampledTurn:
    """One `/generate` call: the ids sent, the ids produced, and q as the sampler really used it."""

    prompt_ids: np.ndarray  # int32 [P]   the input_ids sent, verbatim (never re-tokenised)
    output_ids: np.ndarray  # int32 [n]   sampled token ids
    logprobs: np.ndarray  # float32 [n] full-vocab log q(y) at the sampling temperature (before top-k/p)
    sampled_logprobs: np.ndarray  # float32 [n] log q_S(y) renormalised inside the support (NaN if absent)
    support_offsets: np.ndarray  # int32 [n + 1] CSR row pointers into support_ids / support_logprobs
    support_ids: np.ndarray  # int32 [nnz] candidate ids per token, sorted by probability desc
    support_logprobs: np.ndarray  # float32 [nnz] log q over the candidates (see candidate_mode)
    weight_versions: np.ndarray  # int64 [n] weight version that produced each token
    candidate_mode: str = SUPPORT_MODE  # SUPPORT_MODE or HEAD_MODE
    finish_reason: str = ""  # "stop" | "length" | "abort" | ...
    group: str = ""  # sampler group name
    replica: str = ""  # replica (pod / server) that produced it
    valid: np.ndarray | None = None  # bool [n]; None until validated
    invalid_reasons: dict[str, int] = field(default_factory=dict)  # reason -> count of tokens
    cached_tokens: int = 0  # prompt tokens served from the sampler's prefix cache (meta_info.cached_tokens)
    # int32 [P + n - 1, layers, top_k] or None (not requested): the experts a mixture of experts' router
    # chose at each position p of prompt + output, whose forward gave token p + 1's distribution, so
    # output token i's are row P - 1 + i (SGLang's meta_info.routed_experts, sampler/protocol.py)
    routed_experts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.output_ids.shape[0])

    @property
    def support_sizes(self) -> np.ndarray:
        """int [n] number of candidates per token."""
        return np.diff(self.support_offsets)

    def support(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, logprobs) of output token i's candidate set."""
        lo, hi = int(self.support_offsets[i]), int(self.support_offsets[i + 1])
        return self.support_ids[lo:hi], self.support_logprobs[lo:hi]

    @property
    def num_invalid(self) -> int:
        if self.valid is None:
            raise ValueError("turn not validated yet: call validate() first")
        return int(self.num_tokens - int(self.valid.sum()))

    def validate(self, vocab_size: int | None = None, tol: float = LOGPROB_TOL) -> SampledTurn:
        """Flag invalid tokens in place (see `validate_turn`); returns self."""
        validate_turn(self, vocab_size=vocab_size, tol=tol)
        return self

    @classmethod
    def from_lists(
        cls,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        logprobs: Sequence[float],
        supports: Sequence[Sequence[int]],
        support_logprobs: Sequence[Sequence[float]],
        weight_versions: Sequence[int] | int,
        sampled_logprobs: Sequence[float] | None = None,
        **kwargs: object,
    ) -> SampledTurn:
        """Build a turn from plain Python lists (tests, small tools). Not the fast path."""
        n = len(output_ids)
        sizes = [len(s) for s in supports]
        offsets = np.zeros(len(sizes) + 1, dtype=np.int32)  # len(supports) != n is caught by validate()
        np.cumsum(sizes, out=offsets[1:])
        wv = (
            np.full(n, weight_versions, dtype=np.int64)
            if isinstance(weight_versions, int)
            else weight_versions
        )
        return cls(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
            output_ids=np.asarray(output_ids, dtype=np.int32),
            logprobs=np.asarray(logprobs, dtype=np.float32),
            sampled_logprobs=(
                np.full(n, np.nan, dtype=np.float32)
                if sampled_logprobs is None
                else np.asarray(sampled_logprobs, dtype=np.float32)
            ),
            support_offsets=offsets,
            support_ids=np.asarray([i for s in supports for i in s], dtype=np.int32),
            support_logprobs=np.asarray([x for s in support_logprobs for x in s], dtype=np.float32),
            weight_versions=np.asarray(wv, dtype=np.int64),
            **kwargs,  # type: ignore[arg-type]
        )


# ------------------------------------------------------------------------------------- validation
def _structure_problem(t: SampledTurn) -> str | None:
    """Why the arrays cannot even be interpreted (None when they can)."""
    n = t.num_tokens
    if t.candidate_mode not in CANDIDATE_MODES:
        return f"candidate_mode {t.candidate_mode!r}"
    for name in ("logprobs", "sampled_logprobs", "weight_versions"):
        if getattr(t, name).shape != (n,):
            return f"{name} has shape {getattr(t, name).shape}, expected ({n},)"
    off = t.support_offsets
    if off.shape != (n + 1,):
        return f"support_offsets has shape {off.shape}, expected ({n + 1},)"
    if t.support_ids.shape != t.support_logprobs.shape or t.support_ids.ndim != 1:
        return "support_ids and support_logprobs differ in shape"
    if off[0] != 0 or off[-1] != t.support_ids.shape[0] or (n and (np.diff(off) < 0).any()):
        return "support_offsets are not CSR row pointers"
    return None


def validate_turn(turn: SampledTurn, vocab_size: int | None = None, tol: float = LOGPROB_TOL) -> np.ndarray:
    """Per-token validation; sets `turn.valid` (bool [n]) and `turn.invalid_reasons`; returns `valid`.

    Checks: token id in range (when vocab_size is known), full-vocab logprob finite and <= 0, weight
    version >= 0; in support mode the support is non-empty, finite, sorted by probability desc, holds
    the sampled token, sums to 1 (|logsumexp| <= tol), agrees with `sampled_logprobs` and log q_S(y) >=
    log q(y) (renormalising can only raise a probability); in head mode the head is finite, sorted and
    carries mass <= 1. A token failing any check is invalid; each failed check is counted.
    Vectorised (no Python loop over tokens): this runs on every record the trainer receives.
    """
    n = turn.num_tokens
    reasons: dict[str, int] = {}
    problem = _structure_problem(turn)
    if problem is not None:
        turn.valid = np.zeros(n, dtype=bool)
        turn.invalid_reasons = {R_MALFORMED: max(n, 1)}
        return turn.valid

    bad = np.zeros(n, dtype=bool)

    def flag(reason: str, mask: np.ndarray) -> None:
        count = int(mask.sum())
        if count:
            reasons[reason] = reasons.get(reason, 0) + count
            bad[mask] = True

    out = turn.output_ids.astype(np.int64)
    if vocab_size is not None:
        flag(R_BAD_TOKEN, (out < 0) | (out >= vocab_size))
    else:
        flag(R_BAD_TOKEN, out < 0)
    lp = turn.logprobs.astype(np.float64)
    with np.errstate(invalid="ignore"):
        flag(R_BAD_LOGPROB, ~np.isfinite(lp) | (lp > tol))
    flag(R_BAD_VERSION, turn.weight_versions < 0)

    off = turn.support_offsets.astype(np.int64)
    sizes = np.diff(off)
    nonempty = sizes > 0
    s_lp = turn.support_logprobs.astype(np.float64)
    row = np.repeat(np.arange(n), sizes)  # [nnz] token index of each candidate
    with np.errstate(invalid="ignore"):
        bad_val = ~np.isfinite(s_lp) | (s_lp > tol)
    row_bad_val = np.bincount(row[bad_val], minlength=n) > 0
    flag(R_SUPPORT_NONFINITE, row_bad_val)
    # sorted descending within each row: a later candidate may not be more probable than the one before
    if s_lp.size > 1:
        same_row = row[1:] == row[:-1]
        with np.errstate(invalid="ignore"):
            rises = same_row & (s_lp[1:] > s_lp[:-1] + tol)
        flag(R_UNSORTED, np.bincount(row[1:][rises], minlength=n) > 0)
    # log-mass of each row, shifted by its first (largest) entry for stability
    first = np.zeros(n)
    first[nonempty] = s_lp[off[:-1][nonempty]]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mass = np.bincount(row, weights=np.exp(s_lp - first[row]), minlength=n)
        lse = first + np.log(mass)
    finite_rows = nonempty & ~row_bad_val

    if turn.candidate_mode == SUPPORT_MODE:
        flag(R_EMPTY_SUPPORT, ~nonempty)
        flag(R_NOT_NORMALISED, finite_rows & ~(np.abs(lse) <= tol))
        match = turn.support_ids.astype(np.int64) == out[row]  # [nnz]
        hit_pos = np.flatnonzero(match)
        hit_row = row[hit_pos]
        found = np.zeros(n, dtype=bool)
        found[hit_row] = True
        flag(R_NOT_IN_SUPPORT, nonempty & ~found)
        sampled = turn.sampled_logprobs.astype(np.float64)
        flag(R_SAMPLED_NONFINITE, found & ~np.isfinite(sampled))  # not-found tokens are flagged above
        # the support's logprob of the sampled token (first hit per row)
        support_at_y = np.full(n, np.nan)
        support_at_y[hit_row[::-1]] = s_lp[hit_pos[::-1]]  # reversed so the first hit wins
        with np.errstate(invalid="ignore"):
            flag(R_SAMPLED_MISMATCH, found & np.isfinite(sampled) & (np.abs(sampled - support_at_y) > tol))
            flag(R_RENORM_BELOW_FULL, np.isfinite(sampled) & np.isfinite(lp) & (sampled < lp - tol))
    else:
        with np.errstate(invalid="ignore"):
            flag(R_HEAD_MASS, finite_rows & (lse > tol))

    turn.valid = ~bad
    turn.invalid_reasons = reasons
    return turn.valid


def count_invalid(turns: Iterable[SampledTurn]) -> dict[str, int]:
    """Sum of invalid_reasons over turns (validated ones)."""
    total: dict[str, int] = {}
    for t in turns:
        for k, v in t.invalid_reasons.items():
            total[k] = total.get(k, 0) + v
    return total
