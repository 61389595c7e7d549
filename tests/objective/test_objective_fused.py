"""The fused lm_head + objective (trainer/objective.py `policy_loss(hidden, weight, ...)`, the logits
made tile by tile in trainer/vocab_parallel.py) against the path it replaced, kept as the reference
in tests/objective/materialized.py: the objective on the materialised logits hidden @ weight.T / t.

For every mode (pg, mis, sc, sc_mis; support with and without replay, head; with and without the PPO
clip), on problems with padding and invalid records of each kind, tiles that do not divide the
shapes, and a temperature: the same loss, metrics (whole batch, per group, per staleness bucket) and
gradients of BOTH the hidden states and the weight, in float64 to 1e-10. Hypothesis draws the
problem (the pinned profile of tests/conftest.py).
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from materialized import materialized_policy_loss
from test_objective_tensor_parallel import CASES, problem

from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

TOL = 1e-10


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[key] - b[key]) <= TOL for key in a)


def assert_fused_equals_materialized(seed: int, case: tuple, hidden_size: int, tiles: tuple[int, int], t: float):
    mode, support, replay, ppo = case
    hidden, weight, batch = problem(seed, support, hidden_size=hidden_size)
    config = ObjectiveConfig(mode=mode, replay=replay, ppo_clip=ppo, chunk_tokens=tiles[0], chunk_vocab=tiles[1])
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    reference = materialized_policy_loss(h_ref @ w_ref.T / t, batch, config)
    reference.loss.backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused = policy_loss(h, w, batch, config, temperature=t)
    fused.loss.backward()
    assert reference.metrics["invalid_tokens"] >= 2 and float(w_ref.grad.abs().max()) > 0  # the problem exercises both
    assert abs(float(fused.loss.detach()) - float(reference.loss.detach())) <= TOL, case
    assert float((h.grad - h_ref.grad).abs().max()) <= TOL, case
    assert float((w.grad - w_ref.grad).abs().max()) <= TOL, case
    assert close(fused.metrics, reference.metrics), case
    assert fused.per_group.keys() == reference.per_group.keys()
    assert all(close(fused.per_group[g], reference.per_group[g]) for g in reference.per_group), case
    assert fused.per_staleness.keys() == reference.per_staleness.keys()
    assert all(close(fused.per_staleness[b], reference.per_staleness[b]) for b in reference.per_staleness), case
    if replay:  # rows of the weight outside every support get exactly nothing
        touched = torch.zeros(weight.shape[0], dtype=torch.bool)
        touched[batch.candidate_ids[batch.candidate_ids >= 0]] = True
        touched[batch.tokens] = True
        assert bool((~touched).any()) and float(w.grad[~touched].abs().sum()) == 0.0  # row V - 1 is never a candidate


@settings(max_examples=24, deadline=None)
@given(
    st.integers(0, 10_000),
    st.sampled_from(CASES),
    st.integers(1, 9),
    st.tuples(st.integers(1, 16), st.integers(1, 20)),
    st.sampled_from([1.0, 0.7, 1.3]),
)
def test_fused_equals_materialized(seed, case, hidden_size, tiles, temperature):
    assert_fused_equals_materialized(seed, case, hidden_size, tiles, temperature)


def test_every_mode_fused_equals_materialized():
    """Every case once, with tiles that leave a remainder in both dimensions."""
    for seed, case in enumerate(CASES):
        assert_fused_equals_materialized(seed, case, hidden_size=6, tiles=(4, 7), t=0.8)
