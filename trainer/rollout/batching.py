"""Prompt groups -> one training batch: padded sequences for the forward pass plus one row per
sampled token for the objective.

Positions: the logit that predicts the token at sequence position s sits at position s - 1, so the
row of a sampled token at position s is (sequence b, logit position s - 1). Only sampled (loss-mask
1) positions that the sampler marked valid become rows: prompt and environment ids are context,
never trained on; malformed tokens are dropped and counted. The rows' `target_ids` are exactly the
sampled ids (the loop invariant "tokens trained on are exactly the tokens sampled" is checked here
against the rollout's own token sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from rlfleet.records import HEAD_MODE, SUPPORT_MODE, SampledTurn
from rlfleet.trainer.advantages import grpo_advantages
from rlfleet.trainer.rollout.driver import PromptGroup, Rollout


@dataclass
class FlatBatch:
    """numpy view of a batch; `to_token_batch` turns it into the objective's TokenBatch."""

    input_ids: np.ndarray  # int64 [B, S] right-padded with 0
    seq_lens: np.ndarray  # int64 [B]
    row_seq: np.ndarray  # int64 [T] which sequence each trained token belongs to
    row_pos: np.ndarray  # int64 [T] logit position (token position - 1)
    target_ids: np.ndarray  # int64 [T] the sampled ids
    advantages: np.ndarray  # float32 [T]
    logq: np.ndarray  # float32 [T] full-vocab log q(y)
    logq_support: np.ndarray  # float32 [T] log q_S(y) renormalised in the support (NaN if absent)
    cand_offsets: np.ndarray  # int64 [T + 1] CSR into cand_ids / cand_logq
    cand_ids: np.ndarray  # int64 [nnz]
    cand_logq: np.ndarray  # float32 [nnz]
    candidate_mode: str  # SUPPORT_MODE | HEAD_MODE (one mode per batch)
    versions: np.ndarray  # int64 [T] weight version of each token
    staleness: np.ndarray  # int64 [T] trainer version - the token's SAMPLE's oldest version
    groups: np.ndarray  # object [T] sampler group of each token
    rollout_uids: list[str] = field(default_factory=list)  # one per sequence
    dropped_invalid_tokens: int = 0
    # per sampler group (turn.group): every token it sampled into this batch, the tokens dropped as invalid,
    # and the sampler-side validation reasons (reason -> tokens failing that check; a token may fail several)
    sampled_by_group: dict[str, int] = field(default_factory=dict)
    dropped_by_group: dict[str, int] = field(default_factory=dict)
    invalid_reasons_by_group: dict[str, dict[str, int]] = field(default_factory=dict)
    # int32 [T, layers, top_k] (a mixture of experts whose samplers returned routing; None otherwise):
    # the experts the sampler's router chose at each row's logit position, every id -1 for a row whose
    # turn carried none (trainer/backends/routing.py compares them with the trainer's own)
    routed_experts: np.ndarray | None = None
    trainer_version: int = 0  # the weight version the trainer holds while it trains on this batch

    @property
    def num_tokens(self) -> int:
        return int(self.target_ids.shape[0])


def flatten_groups(
    groups: Sequence[PromptGroup],
    trainer_version: int,
    normalize_std: bool = False,
) -> FlatBatch:
    rollouts: list[Rollout] = []
    adv_per_rollout: list[float] = []
    for g in groups:
        rewards = np.array([r.scored.reward for r in g.rollouts], dtype=np.float64)
        group_adv = grpo_advantages(rewards, normalize_std=normalize_std)
        rollouts.extend(g.rollouts)
        adv_per_rollout.extend(float(a) for a in group_adv)

    seqs = [r.token_ids() for r in rollouts]
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    input_ids = np.zeros((len(seqs), int(lens.max()) if len(seqs) else 0), dtype=np.int64)
    for b, s in enumerate(seqs):
        input_ids[b, : len(s)] = s

    cols: dict[str, list] = {
        k: [] for k in ("seq", "pos", "tgt", "adv", "logq", "logqs", "ver", "stale", "grp")
    }
    cand_ids: list[np.ndarray] = []
    cand_logq: list[np.ndarray] = []
    cand_counts: list[int] = []
    modes: set[str] = set()
    dropped = 0
    sampled_by_group: dict[str, int] = {}
    dropped_by_group: dict[str, int] = {}
    reasons_by_group: dict[str, dict[str, int]] = {}
    routed_rows: list[
        np.ndarray | None
    ] = []  # per row, its sampler routing [layers, top_k] (None: not returned)
    for b, (r, adv) in enumerate(zip(rollouts, adv_per_rollout, strict=True)):
        sample_stale = max(0, trainer_version - r.min_version)
        pos = len(r.prompt.input_ids)
        for turn, env in zip(r.turns, r.env_ids, strict=True):
            modes.add(turn.candidate_mode)
            valid = (
                np.ones(turn.num_tokens, dtype=bool)
                if turn.valid is None
                else np.asarray(turn.valid, dtype=bool)
            )
            offs = np.asarray(turn.support_offsets, dtype=np.int64)
            routed = (
                turn.routed_experts
            )  # row P - 1 + i for output token i, P = pos (prompt_ids = the ids so far)
            _count_turn(turn, valid, sampled_by_group, dropped_by_group, reasons_by_group)
            for i in range(turn.num_tokens):
                token_pos = pos + i
                if not valid[i]:
                    dropped += 1
                    continue
                tgt = int(turn.output_ids[i])
                if (
                    seqs[b][token_pos] != tgt
                ):  # the invariant: we train on the sampled ids, at their positions
                    raise AssertionError(f"{r.uid}: token {token_pos} is {seqs[b][token_pos]}, sampled {tgt}")
                cols["seq"].append(b)
                cols["pos"].append(token_pos - 1)
                cols["tgt"].append(tgt)
                cols["adv"].append(adv)
                cols["logq"].append(float(turn.logprobs[i]))
                cols["logqs"].append(float(turn.sampled_logprobs[i]))
                cols["ver"].append(int(turn.weight_versions[i]))
                cols["stale"].append(sample_stale)
                cols["grp"].append(turn.group)
                lo, hi = int(offs[i]), int(offs[i + 1])
                cand_ids.append(np.asarray(turn.support_ids[lo:hi], dtype=np.int64))
                cand_logq.append(np.asarray(turn.support_logprobs[lo:hi], dtype=np.float32))
                cand_counts.append(hi - lo)
                routed_rows.append(None if routed is None else routed[token_pos - 1])
            pos += turn.num_tokens + len(env)
    if len(modes) > 1:
        raise ValueError(f"a batch mixes candidate modes {sorted(modes)}; configure one mode per run")
    offsets = np.zeros(len(cand_counts) + 1, dtype=np.int64)
    np.cumsum(cand_counts, out=offsets[1:])
    return FlatBatch(
        input_ids=input_ids,
        seq_lens=lens,
        row_seq=np.array(cols["seq"], dtype=np.int64),
        row_pos=np.array(cols["pos"], dtype=np.int64),
        target_ids=np.array(cols["tgt"], dtype=np.int64),
        advantages=np.array(cols["adv"], dtype=np.float32),
        logq=np.array(cols["logq"], dtype=np.float32),
        logq_support=np.array(cols["logqs"], dtype=np.float32),
        cand_offsets=offsets,
        cand_ids=np.concatenate(cand_ids) if cand_ids else np.zeros(0, dtype=np.int64),
        cand_logq=np.concatenate(cand_logq) if cand_logq else np.zeros(0, dtype=np.float32),
        candidate_mode=modes.pop() if modes else SUPPORT_MODE,
        versions=np.array(cols["ver"], dtype=np.int64),
        staleness=np.array(cols["stale"], dtype=np.int64),
        groups=np.array(cols["grp"], dtype=object),
        rollout_uids=[r.uid for r in rollouts],
        dropped_invalid_tokens=dropped,
        sampled_by_group=sampled_by_group,
        dropped_by_group=dropped_by_group,
        invalid_reasons_by_group=reasons_by_group,
        routed_experts=_routed_experts_per_row(routed_rows),
        trainer_version=trainer_version,
    )


def _count_turn(
    turn: SampledTurn,
    valid: np.ndarray,
    sampled: dict[str, int],
    dropped: dict[str, int],
    reasons: dict[str, dict[str, int]],
) -> None:
    """Add one turn's tokens to its group's sampled, dropped and per-reason counts (the per-group view
    of what a group that answers garbage costs: trainer/metrics.py `invalid_token_metrics`)."""
    sampled[turn.group] = sampled.get(turn.group, 0) + turn.num_tokens
    bad = int(turn.num_tokens - int(valid.sum()))
    if bad:
        dropped[turn.group] = dropped.get(turn.group, 0) + bad
    for reason, count in turn.invalid_reasons.items():
        into = reasons.setdefault(turn.group, {})
        into[reason] = into.get(reason, 0) + int(count)


def _routed_experts_per_row(rows: list[np.ndarray | None]) -> np.ndarray | None:
    """Per-row sampler routing -> int32 [T, layers, top_k] (-1 for a row without), None when no row has any."""
    known = [r for r in rows if r is not None]
    if not known:
        return None
    shapes = {r.shape for r in known}
    if len(shapes) > 1:
        raise ValueError(f"a batch's routed experts differ in [layers, top_k]: {sorted(shapes)}")
    out = np.full((len(rows), *known[0].shape), -1, dtype=np.int32)
    for i, r in enumerate(rows):
        if r is not None:
            out[i] = r
    return out


@dataclass(frozen=True)
class MicroBatch:
    """Some sequences of a FlatBatch trained in one forward and backward: `seqs` (sequence indices) and
    `lengths`, the tokens each one needs (through its last sampled token: causal attention makes what
    follows irrelevant to every trained row). `rows` are the FlatBatch rows of these sequences."""

    seqs: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n]
    rows: np.ndarray  # int64 [R] rows of the FlatBatch whose sequence is in `seqs`

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed micro-batch (no padding)."""
        return int(self.lengths.sum())

    def packed(self, flat: FlatBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The sequences back to back: (input_ids [L], position_ids [L] restarting at 0 for each sequence,
        the index in [0, L) of each row's logit), L = `num_tokens`."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        input_ids = np.concatenate(
            [flat.input_ids[b, :n] for b, n in zip(self.seqs, self.lengths, strict=True)]
        )
        position_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in self.lengths])
        start_of = dict(zip(self.seqs.tolist(), starts.tolist(), strict=True))
        row_index = (
            np.array([start_of[int(b)] for b in flat.row_seq[self.rows]], dtype=np.int64)
            + flat.row_pos[self.rows]
        )
        return input_ids.astype(np.int64), position_ids, row_index


def needed_lengths(flat: FlatBatch) -> np.ndarray:
    """Per sequence, the tokens its trained rows need: its last row's logit position + 1 (0 without rows)."""
    need = np.zeros(int(flat.input_ids.shape[0]), dtype=np.int64)
    np.maximum.at(need, flat.row_seq, flat.row_pos + 1)
    return need


def plan_micro_batches(flat: FlatBatch, seqs: np.ndarray, max_tokens: int) -> list[MicroBatch]:
    """`seqs` of `flat` packed (back to back) into micro-batches of at most `max_tokens` tokens each:
    first-fit decreasing on the sum of lengths, longest first. A sequence longer than the budget alone is one micro-batch of its own (it
    cannot be split without context parallelism). Sequences without a trained row are left out."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens per micro-batch must be >= 1, got {max_tokens}")
    need = needed_lengths(flat)
    seqs = np.asarray(seqs, dtype=np.int64)
    order = [int(b) for b in sorted(seqs.tolist(), key=lambda b: (-need[b], b)) if need[b] > 0]
    bins: list[list[int]] = []
    used: list[int] = []
    for b in order:
        n = int(need[b])
        for i, members in enumerate(bins):
            if used[i] + n <= max_tokens:
                members.append(b)
                used[i] += n
                break
        else:
            bins.append([b])
            used.append(n)
    out = []
    for members in bins:
        ids = np.array(members, dtype=np.int64)
        out.append(MicroBatch(seqs=ids, lengths=need[ids], rows=np.flatnonzero(np.isin(flat.row_seq, ids))))
    return out


__all__ = [
    "FlatBatch",
    "MicroBatch",
    "flatten_groups",
    "needed_lengths",
    "plan_micro_batches",
    "HEAD_MODE",
    "SUPPORT_MODE",
]
