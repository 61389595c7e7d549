"""SampledTurn validation, the compact transport and token-exact multi-turn trajectories."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet import records as rec
from rlfleet.records import HEAD_MODE, SampledTurn, Trajectory, decode_turns, encode_turns, validate_turn


def _turn(
    rng: np.random.Generator, n: int, k: int, vocab: int = 1000, prompt=(1, 2, 3), version=3
) -> SampledTurn:
    """A well-formed support-mode turn: supports of size 1..k, renormalised, sampled token inside."""
    sizes = rng.integers(1, k + 1, size=n)
    out, lp, slp, sids, slps = [], [], [], [], []
    for m in sizes:
        ids = rng.choice(vocab, size=m, replace=False)
        logits = np.sort(rng.normal(size=m))[::-1]
        ren = logits - np.log(np.exp(logits).sum())
        j = int(rng.integers(m))
        out.append(int(ids[j]))
        slp.append(ren[j])
        lp.append(ren[j] - rng.uniform(0, 2))  # full-vocab logprob <= renormalised
        sids.append(ids.tolist())
        slps.append(ren.tolist())
    return SampledTurn.from_lists(prompt, out, lp, sids, slps, version, sampled_logprobs=slp)


def test_well_formed_turn_is_all_valid():
    t = _turn(np.random.default_rng(0), 50, 64).validate(vocab_size=1000)
    assert t.valid.all() and t.invalid_reasons == {} and t.num_invalid == 0


@pytest.mark.parametrize(
    "breaker,reason",
    [
        (lambda t: t.output_ids.__setitem__(4, 99999), rec.R_NOT_IN_SUPPORT),
        (lambda t: t.logprobs.__setitem__(4, np.nan), rec.R_BAD_LOGPROB),
        (lambda t: t.logprobs.__setitem__(4, 0.5), rec.R_BAD_LOGPROB),
        (lambda t: t.weight_versions.__setitem__(4, -1), rec.R_BAD_VERSION),
        (lambda t: t.sampled_logprobs.__setitem__(4, np.nan), rec.R_SAMPLED_NONFINITE),
        (lambda t: t.sampled_logprobs.__setitem__(4, t.sampled_logprobs[4] - 0.1), rec.R_SAMPLED_MISMATCH),
        (lambda t: t.logprobs.__setitem__(4, t.sampled_logprobs[4] + 0.01), rec.R_RENORM_BELOW_FULL),
    ],
)
def test_each_defect_flags_exactly_that_token(breaker, reason):
    t = _turn(np.random.default_rng(1), 10, 8, vocab=50000)
    breaker(t)
    t.validate()
    assert not t.valid[4] and t.valid.sum() == 9
    assert reason in t.invalid_reasons


def test_support_sum_sorting_and_emptiness():
    t = _turn(np.random.default_rng(2), 6, 8)
    lo, hi = t.support_offsets[2], t.support_offsets[3]
    t.support_logprobs[lo:hi] -= 0.01  # mass exp(-0.01): off by 1%, beyond 1e-3 tolerance
    t.validate()
    assert t.invalid_reasons == {rec.R_NOT_NORMALISED: 1, rec.R_SAMPLED_MISMATCH: 1} and not t.valid[2]
    # swap the first two candidates of a row with distinct probabilities -> unsorted
    t = _turn(np.random.default_rng(3), 6, 8)
    row = int(np.argmax(t.support_sizes >= 2))
    lo = t.support_offsets[row]
    t.support_ids[lo : lo + 2] = t.support_ids[lo : lo + 2][::-1].copy()
    t.support_logprobs[lo : lo + 2] = t.support_logprobs[lo : lo + 2][::-1].copy()
    validate_turn(t)
    assert rec.R_UNSORTED in t.invalid_reasons and not t.valid[row]
    # an empty support in support mode
    t = SampledTurn.from_lists(
        [1], [5, 6], [-1.0, -1.0], [[5], []], [[0.0], []], 0, sampled_logprobs=[0.0, 0.0]
    )
    t.validate()
    assert t.valid.tolist() == [True, False] and rec.R_EMPTY_SUPPORT in t.invalid_reasons


def test_malformed_structure_invalidates_the_whole_turn():
    t = _turn(np.random.default_rng(4), 5, 4)
    t.support_offsets = t.support_offsets[:-1]
    t.validate()
    assert not t.valid.any() and t.invalid_reasons == {rec.R_MALFORMED: 5}


def test_head_mode_allows_sampled_outside_head_but_not_mass_above_one():
    t = SampledTurn.from_lists(
        [1], [9, 3], [-3.0, -0.5], [[1, 2], [3, 4]], [[-0.5, -1.2], [-0.1, -0.2]], 2, candidate_mode=HEAD_MODE
    )
    t.validate()
    # token 0: 9 is not in its head (fine in head mode); token 1: head mass e^-.1 + e^-.2 > 1
    assert t.valid.tolist() == [True, False] and t.invalid_reasons == {rec.R_HEAD_MASS: 1}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.lists(st.integers(0, 12), min_size=0, max_size=5), st.booleans())
def test_transport_round_trip_is_exact(seed, lengths, validate):
    rng = np.random.default_rng(seed)
    turns = []
    for i, n in enumerate(lengths):
        t = _turn(rng, n, 9, prompt=tuple(range(i + 1)), version=i)
        t.weight_versions[n // 2 :] += 1  # a mid-turn weight update: two runs
        t.finish_reason, t.group, t.replica, t.cached_tokens = "stop", f"g{i}", f"r{i}", i
        if validate:
            t.validate()
        turns.append(t)
    back = decode_turns(encode_turns(turns))
    assert len(back) == len(turns)
    for a, b in zip(turns, back, strict=True):
        for name in ("prompt_ids", "output_ids", "support_offsets", "support_ids", "weight_versions"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
            assert getattr(a, name).dtype == getattr(b, name).dtype
        for name in ("logprobs", "sampled_logprobs", "support_logprobs"):
            assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True)
        assert (
            a.finish_reason,
            a.group,
            a.replica,
            a.cached_tokens,
            a.invalid_reasons,
            a.candidate_mode,
        ) == (b.finish_reason, b.group, b.replica, b.cached_tokens, b.invalid_reasons, b.candidate_mode)
        assert (a.valid is None and b.valid is None) or np.array_equal(a.valid, b.valid)


def test_transport_bytes_per_token_at_k64_and_corruption():
    rng = np.random.default_rng(5)
    t = _turn(rng, 256, 64)
    t.support_offsets = np.arange(257, dtype=np.int32) * 64  # exactly K = 64 everywhere
    t.support_ids = rng.integers(0, 1000, 256 * 64).astype(np.int32)
    t.support_logprobs = np.full(256 * 64, -np.log(64), dtype=np.float32)
    blob = encode_turns([t])
    per_token = len(blob) / 256
    # 64 * (4 + 4) candidate bytes + id, logprob, sampled logprob, offset: 528; the rest is overhead
    assert 528 <= per_token <= 540
    with pytest.raises(rec.TransportError):
        decode_turns(blob[:-8])
    with pytest.raises(rec.TransportError):
        decode_turns(b"nope" + blob)
    with pytest.raises(rec.TransportError):
        decode_turns(blob + b"\0\0\0\0")


def test_trajectory_is_token_exact_across_turns():
    rng = np.random.default_rng(6)
    traj = Trajectory([10, 11, 12], session_id="p0/0")
    t1 = _turn(rng, 4, 5, prompt=traj.next_prompt_ids()).validate()
    traj.add_turn(t1)
    traj.add_environment([500, 501])
    t2 = _turn(rng, 3, 5, prompt=traj.next_prompt_ids(), version=4).validate()
    traj.add_turn(t2)
    ids = traj.token_ids
    assert ids.tolist() == [10, 11, 12, *t1.output_ids.tolist(), 500, 501, *t2.output_ids.tolist()]
    assert traj.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1]
    arr = traj.arrays()
    sampled = arr.loss_mask == 1
    assert np.array_equal(arr.logprobs[sampled], np.r_[t1.logprobs, t2.logprobs])
    assert np.isnan(arr.logprobs[~sampled]).all() and (arr.weight_versions[~sampled] == -1).all()
    assert arr.weight_versions[sampled].tolist() == [3] * 4 + [4] * 3
    assert arr.valid.tolist() == sampled.tolist()
    sizes = np.diff(arr.support_offsets)
    assert (sizes[~sampled] == 0).all() and np.array_equal(
        sizes[sampled], np.r_[t1.support_sizes, t2.support_sizes]
    )
    assert np.array_equal(arr.support_ids, np.r_[t1.support_ids, t2.support_ids])
    # a turn whose prompt is not the trajectory so far (e.g. re-tokenised text) is refused
    bad = _turn(rng, 2, 3, prompt=[10, 11, 12])
    with pytest.raises(rec.TokenMismatchError):
        traj.add_turn(bad)
    with pytest.raises(ValueError, match="negative"):
        traj.add_environment([-1])
