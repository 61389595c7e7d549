"""SampledTurn validation."""

from __future__ import annotations

import numpy as np
import pytest

from rlfleet import records as rec
from rlfleet.records import HEAD_MODE, SampledTurn, validate_turn


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
