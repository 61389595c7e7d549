"""Weighted rendezvous hashing: shares, stickiness, minimal movement (property tests)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.router import hashing

N_KEYS = 6000
KEYS = [hashing.key_hash(f"session-{i}") for i in range(N_KEYS)]
NAMES = ["a100-bf16", "h100-fp8", "h200-fp8", "b200-nvfp4", "b300-nvfp4", "rtx-nvfp4"]

weights_strategy = st.integers(min_value=2, max_value=6).flatmap(
    lambda n: st.lists(st.floats(min_value=0.05, max_value=10.0), min_size=n, max_size=n).map(
        lambda ws: dict(zip(NAMES[:n], ws, strict=True))
    )
)
# (weights, one of their groups)
weights_and_one_group = weights_strategy.flatmap(lambda w: st.tuples(st.just(w), st.sampled_from(sorted(w))))


def assign(weights: dict[str, float]) -> list[str | None]:
    seeds = {m: hashing.member_seed(m) for m in weights}
    return [hashing.pick(k, weights, seeds) for k in KEYS]


def moved_fraction(a: list[str | None], b: list[str | None]) -> float:
    return sum(x != y for x, y in zip(a, b, strict=True)) / len(a)


@settings(max_examples=15, deadline=None)
@given(weights_strategy)
def test_each_group_gets_its_share_of_sessions(weights: dict[str, float]) -> None:
    assignment = assign(weights)
    shares = hashing.normalise(weights)
    for name, share in shares.items():
        observed = assignment.count(name) / N_KEYS
        # 4.5 binomial standard deviations: a real bias of 2% would fail, noise does not.
        assert abs(observed - share) <= 4.5 * math.sqrt(share * (1 - share) / N_KEYS) + 1e-9, (
            name,
            observed,
            share,
        )


@settings(max_examples=15, deadline=None)
@given(weights_strategy, st.floats(min_value=0.01, max_value=100.0))
def test_scaling_all_weights_moves_nothing(weights: dict[str, float], factor: float) -> None:
    scaled = {m: w * factor for m, w in weights.items()}
    assert assign(weights) == assign(scaled)


@settings(max_examples=20, deadline=None)
@given(weights_and_one_group, st.floats(min_value=0.0, max_value=10.0))
def test_changing_one_weight_moves_at_most_delta_plus_2_percent_and_only_through_that_group(
    weights_and_changed: tuple[dict[str, float], str], new_weight: float
) -> None:
    weights, changed = weights_and_changed
    after = {**weights, changed: new_weight}
    before_assignment, after_assignment = assign(weights), assign(after)
    delta = hashing.total_variation(weights, after)
    assert moved_fraction(before_assignment, after_assignment) <= delta + 0.02
    for old, new in zip(before_assignment, after_assignment, strict=True):
        if old != new:
            # Every move goes into or out of the changed group: nobody else is disturbed.
            assert changed in (old, new)


@settings(max_examples=20, deadline=None)
@given(weights_strategy, st.data())
def test_any_weight_change_moves_the_p_minhash_optimum(
    weights: dict[str, float], data: st.DataObject
) -> None:
    """Several weights at once: the exact expectation is 1 - J_P, between TV and 2 TV / (1 + TV)."""
    factors = data.draw(st.lists(st.floats(0.5, 2.0), min_size=len(weights), max_size=len(weights)))
    after = {m: w * f for (m, w), f in zip(weights.items(), factors, strict=True)}
    moved = moved_fraction(assign(weights), assign(after))
    expected = hashing.expected_moved_fraction(weights, after)
    tv = hashing.total_variation(weights, after)
    assert tv - 1e-12 <= expected <= 2 * tv / (1 + tv) + 1e-12
    assert abs(moved - expected) <= 0.02


@settings(max_examples=20, deadline=None)
@given(weights_and_one_group)
def test_removing_a_group_moves_only_its_sessions_and_they_come_back(
    weights_and_removed: tuple[dict[str, float], str],
) -> None:
    weights, removed = weights_and_removed
    without = {m: w for m, w in weights.items() if m != removed}
    before, during = assign(weights), assign(without)
    for old, new in zip(before, during, strict=True):
        if old != removed:
            assert new == old
        else:
            assert new is not None and new != removed
    assert assign(weights) == before


def test_rank_starts_with_pick_and_falls_back_deterministically() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 0.0, "d": 0.5}
    seeds = {m: hashing.member_seed(m) for m in weights}
    for key in KEYS[:500]:
        order = hashing.rank(key, weights, seeds)
        assert order[0] == hashing.pick(key, weights, seeds)
        assert sorted(order) == ["a", "b", "d"]  # zero weight is never chosen
        without_first = {m: w for m, w in weights.items() if m != order[0]}
        assert hashing.pick(key, without_first, seeds) == order[1]


def test_no_positive_weight_picks_nothing() -> None:
    assert hashing.pick("k", {"a": 0.0}) is None
    assert hashing.rank("k", {}) == []


def test_key_hash_is_stable_across_processes() -> None:
    # Pinned value: a router restart (or a second router replica) must hash a session identically.
    assert hashing.key_hash("session-0") == int.from_bytes(
        __import__("hashlib").blake2b(b"session-0", digest_size=8).digest(), "little"
    )
    assert 0.0 < hashing.unit_value(0, 0) < 1.0
    assert 0.0 < hashing.unit_value((1 << 64) - 1, 0) < 1.0
