"""Token records: what a sampler produced, token-exact, as the trainer must score it.

This is the contract between the sampler side (which fills it from SGLang's `meta_info`), the rollout
driver (which assembles trajectories) and the objective (which turns a batch into a `TokenBatch`).
Arrays are numpy so that the core and the operator never import torch.

Support sets are stored CSR-style: the support of output token i is
`support_ids[support_offsets[i]:support_offsets[i+1]]` (sorted by probability, descending) with the
matching `support_logprobs` (renormalised inside the support in `support` mode; a top-K head of the
full-vocabulary distribution in `head` mode).

Besides the record itself this module holds:
- `validate_turn` (also `SampledTurn.validate`): per-token checks; invalid tokens are flagged in
  `valid` and counted by reason in `invalid_reasons`, never silently used and never raised.
- `encode_turns` / `decode_turns`: the compact binary transport (CSR int32 ids + float32 logprobs).
- `Trajectory`: a multi-turn session kept token-exact: every id in order, loss mask 1 on sampled
  tokens, environment tokens appended as ids with mask 0, nothing detokenised or re-tokenised.
"""

from __future__ import annotations

import json
import struct
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


# ------------------------------------------------------------------------------------- transport
# Layout: MAGIC | u32 header_len | header (JSON, utf-8) | per turn, in order, raw little-endian buffers:
#   prompt_ids int32[P], output_ids int32[n], logprobs f32[n], sampled_logprobs f32[n],
#   support_offsets int32[n+1], support_ids int32[nnz], support_logprobs f32[nnz],
#   weight-version runs (int64 values[r], int32 lengths[r]), valid uint8[n] (only if validated),
#   zero padding to a multiple of 4.
# Weight versions are run-length coded: a turn almost always has one or two versions.
TRANSPORT_MAGIC = b"RLFTR\x01"
_TURN_META_KEYS = ("candidate_mode", "finish_reason", "group", "replica", "invalid_reasons", "cached_tokens")


class TransportError(ValueError):
    """The bytes are not a valid encoded batch of turns."""


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if values.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    starts = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    lengths = np.diff(np.r_[starts, values.size])
    return values[starts].astype(np.int64), lengths.astype(np.int32)


def encode_turns(turns: Sequence[SampledTurn]) -> bytes:
    """Compact binary encoding of turns (CSR int32 ids + float32 logprobs); see `decode_turns`."""
    metas = []
    chunks: list[bytes] = []
    for t in turns:
        wv_values, wv_lengths = _runs(np.asarray(t.weight_versions, dtype=np.int64))
        meta = {k: getattr(t, k) for k in _TURN_META_KEYS}
        meta.update(
            p=int(t.prompt_ids.shape[0]),
            n=t.num_tokens,
            nnz=int(t.support_ids.shape[0]),
            runs=int(wv_values.shape[0]),
            validated=t.valid is not None,
        )
        metas.append(meta)
        parts = [
            np.ascontiguousarray(t.prompt_ids, dtype="<i4"),
            np.ascontiguousarray(t.output_ids, dtype="<i4"),
            np.ascontiguousarray(t.logprobs, dtype="<f4"),
            np.ascontiguousarray(t.sampled_logprobs, dtype="<f4"),
            np.ascontiguousarray(t.support_offsets, dtype="<i4"),
            np.ascontiguousarray(t.support_ids, dtype="<i4"),
            np.ascontiguousarray(t.support_logprobs, dtype="<f4"),
            wv_values.astype("<i8"),
            wv_lengths.astype("<i4"),
        ]
        if t.valid is not None:
            parts.append(np.ascontiguousarray(t.valid, dtype=np.uint8))
        blob = b"".join(p.tobytes() for p in parts)
        chunks.append(blob + b"\0" * (-len(blob) % 4))
    header = json.dumps(metas, separators=(",", ":")).encode()
    return TRANSPORT_MAGIC + struct.pack("<I", len(header)) + header + b"".join(chunks)


def decode_turns(data: bytes | memoryview) -> list[SampledTurn]:
    """Inverse of `encode_turns`. Raises TransportError on truncated or foreign bytes."""
    buf = memoryview(data)
    m = len(TRANSPORT_MAGIC)
    if bytes(buf[:m]) != TRANSPORT_MAGIC or len(buf) < m + 4:
        raise TransportError("not an rlfleet turn batch (bad magic)")
    (hlen,) = struct.unpack_from("<I", buf, m)
    pos = m + 4 + hlen
    try:
        metas = json.loads(bytes(buf[m + 4 : pos]))
    except ValueError as exc:
        raise TransportError(f"corrupt header: {exc}") from None
    turns = []

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal pos
        size = np.dtype(dtype).itemsize * count
        if pos + size > len(buf):
            raise TransportError("truncated turn batch")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
        pos += size
        return arr

    for meta in metas:
        start = pos
        n, nnz = meta["n"], meta["nnz"]
        prompt = take("<i4", meta["p"]).astype(np.int32)
        out = take("<i4", n).astype(np.int32)
        lp = take("<f4", n).astype(np.float32)
        slp = take("<f4", n).astype(np.float32)
        off = take("<i4", n + 1).astype(np.int32)
        sid = take("<i4", nnz).astype(np.int32)
        slps = take("<f4", nnz).astype(np.float32)
        wv_values = take("<i8", meta["runs"])
        wv_lengths = take("<i4", meta["runs"])
        valid = take("u1", n).astype(bool) if meta["validated"] else None
        pos += -(pos - start) % 4
        wv = np.repeat(wv_values, wv_lengths).astype(np.int64)
        if wv.shape[0] != n:
            raise TransportError("weight-version runs do not cover the turn")
        turns.append(
            SampledTurn(
                prompt_ids=prompt,
                output_ids=out,
                logprobs=lp,
                sampled_logprobs=slp,
                support_offsets=off,
                support_ids=sid,
                support_logprobs=slps,
                weight_versions=wv,
                valid=valid,
                **{k: meta[k] for k in _TURN_META_KEYS},
            )
        )
    if pos != len(buf):
        raise TransportError(f"{len(buf) - pos} trailing bytes after the last turn")
    return turns


# ------------------------------------------------------------------------------------- trajectories
class TokenMismatchError(ValueError):
    """A turn's prompt is not exactly the trajectory so far (something re-tokenised or dropped ids)."""


@dataclass
class TrajectoryArrays:
    """A trajectory flattened for the trainer: per-position arrays aligned with token_ids [T].

    Sampled positions (loss_mask 1) carry their record; prompt and environment positions carry NaN
    logprobs, weight version -1, valid False and an empty candidate row."""

    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # int8 [T] 1 = sampled by the policy, 0 = prompt / environment
    logprobs: np.ndarray  # float32 [T]
    sampled_logprobs: np.ndarray  # float32 [T]
    weight_versions: np.ndarray  # int64 [T]
    valid: np.ndarray  # bool [T]
    support_offsets: np.ndarray  # int32 [T + 1]
    support_ids: np.ndarray  # int32 [nnz]
    support_logprobs: np.ndarray  # float32 [nnz]
    candidate_mode: str


class Trajectory:
    """A multi-turn session, token-exact.

    Start with the first prompt's ids; every `/generate` turn must be sent exactly
    `next_prompt_ids()` and is appended with `add_turn` (checked: its `prompt_ids` must equal the
    trajectory so far); environment observations are appended with `add_environment(ids)` as ids with
    loss mask 0. Nothing is ever detokenised and re-tokenised."""

    def __init__(self, prompt_ids: Sequence[int] | np.ndarray, session_id: str = "") -> None:
        self.session_id = session_id
        self._ids: list[int] = _as_id_list(prompt_ids, "prompt_ids")
        self._mask: list[int] = [0] * len(self._ids)
        self.turns: list[SampledTurn] = []
        self.turn_starts: list[int] = []  # position in token_ids where each turn's outputs begin
        self.prompt_len = len(self._ids)

    def __len__(self) -> int:
        return len(self._ids)

    def next_prompt_ids(self) -> list[int]:
        """The exact input_ids for the next `/generate` call: every token so far."""
        return list(self._ids)

    def add_turn(self, turn: SampledTurn) -> None:
        if self.turns and turn.candidate_mode != self.turns[0].candidate_mode:
            raise ValueError("all turns of a trajectory must share one candidate_mode")
        sent = turn.prompt_ids
        if sent.shape[0] != len(self._ids) or not np.array_equal(
            sent, np.asarray(self._ids, dtype=sent.dtype)
        ):
            raise TokenMismatchError(
                f"turn prompt ({sent.shape[0]} ids) is not the trajectory so far ({len(self._ids)} ids): "
                "send next_prompt_ids() verbatim"
            )
        self.turn_starts.append(len(self._ids))
        self.turns.append(turn)
        self._ids.extend(int(i) for i in turn.output_ids)
        self._mask.extend([1] * turn.num_tokens)

    def add_environment(self, ids: Sequence[int] | np.ndarray) -> None:
        new = _as_id_list(ids, "environment ids")
        self._ids.extend(new)
        self._mask.extend([0] * len(new))

    @property
    def token_ids(self) -> np.ndarray:
        return np.asarray(self._ids, dtype=np.int32)

    @property
    def loss_mask(self) -> np.ndarray:
        return np.asarray(self._mask, dtype=np.int8)

    @property
    def num_sampled(self) -> int:
        return sum(t.num_tokens for t in self.turns)

    def arrays(self) -> TrajectoryArrays:
        """Flatten for the trainer. Tokens of turns that were never validated count as invalid."""
        total = len(self._ids)
        lp = np.full(total, np.nan, dtype=np.float32)
        slp = np.full(total, np.nan, dtype=np.float32)
        wv = np.full(total, -1, dtype=np.int64)
        valid = np.zeros(total, dtype=bool)
        sizes = np.zeros(total, dtype=np.int64)
        for start, t in zip(self.turn_starts, self.turns, strict=True):
            sl = slice(start, start + t.num_tokens)
            lp[sl], slp[sl], wv[sl] = t.logprobs, t.sampled_logprobs, t.weight_versions
            valid[sl] = t.valid if t.valid is not None else False
            sizes[sl] = t.support_sizes
        offsets = np.zeros(total + 1, dtype=np.int32)
        np.cumsum(sizes, out=offsets[1:])
        empty_i = np.zeros(0, np.int32)
        empty_f = np.zeros(0, np.float32)
        return TrajectoryArrays(
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=lp,
            sampled_logprobs=slp,
            weight_versions=wv,
            valid=valid,
            support_offsets=offsets,
            support_ids=np.concatenate([empty_i, *(t.support_ids for t in self.turns)]).astype(np.int32),
            support_logprobs=np.concatenate([empty_f, *(t.support_logprobs for t in self.turns)]).astype(
                np.float32
            ),
            candidate_mode=self.turns[0].candidate_mode if self.turns else SUPPORT_MODE,
        )


def _as_id_list(ids: Sequence[int] | np.ndarray, what: str) -> list[int]:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} must be a flat sequence of integer token ids")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{what} contains a negative token id")
    return [int(i) for i in arr]
