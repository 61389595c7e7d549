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

from decimal import Decimal, localcontext

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from materialized import log_softmax_at, materialized_policy_loss
from test_objective_tensor_parallel import CASES, problem

from rlfleet.trainer.objective import ObjectiveConfig, policy_loss
from rlfleet.trainer.vocab_parallel import fused_log_softmax_at

TOL = 1e-10


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[key] - b[key]) <= TOL for key in a)


def assert_fused_equals_materialized(
    seed: int, case: tuple, hidden_size: int, tiles: tuple[int, int], t: float
):
    mode, support, replay, ppo = case
    hidden, weight, batch = problem(seed, support, hidden_size=hidden_size)
    config = ObjectiveConfig(
        mode=mode, replay=replay, ppo_clip=ppo, chunk_tokens=tiles[0], chunk_vocab=tiles[1]
    )
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    reference = materialized_policy_loss(h_ref @ w_ref.T / t, batch, config)
    reference.loss.backward()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused = policy_loss(h, w, batch, config, temperature=t)
    fused.loss.backward()
    assert (
        reference.metrics["invalid_tokens"] >= 2 and float(w_ref.grad.abs().max()) > 0
    )  # the problem exercises both
    assert abs(float(fused.loss.detach()) - float(reference.loss.detach())) <= TOL, case
    assert float((h.grad - h_ref.grad).abs().max()) <= TOL, case
    assert float((w.grad - w_ref.grad).abs().max()) <= TOL, case
    assert close(fused.metrics, reference.metrics), case
    assert fused.per_group.keys() == reference.per_group.keys()
    assert all(close(fused.per_group[g], reference.per_group[g]) for g in reference.per_group), case
    assert fused.per_staleness.keys() == reference.per_staleness.keys()
    assert all(close(fused.per_staleness[b], reference.per_staleness[b]) for b in reference.per_staleness), (
        case
    )
    if replay:  # rows of the weight outside every support get exactly nothing
        touched = torch.zeros(weight.shape[0], dtype=torch.bool)
        touched[batch.candidate_ids[batch.candidate_ids >= 0]] = True
        touched[batch.tokens] = True
        assert (
            bool((~touched).any()) and float(w.grad[~touched].abs().sum()) == 0.0
        )  # row V - 1 is never a candidate


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


# --- the backward at an extreme centering ratio -------------------------------------------------------


def exact_logit_gradient(z: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor) -> list[list[Decimal]]:
    """d/dz_u sum_m g_m log p(v_m) = sum_m g_m 1[u = v_m] - (sum_m g_m) p(u), in 60-digit decimal arithmetic
    from the exact values of the inputs (the float rounding of the result is the only error left)."""
    exact = []
    with localcontext() as context:
        context.prec = 60
        for row, row_ids, row_grad in zip(z.tolist(), ids.tolist(), grad_out.tolist(), strict=True):
            logits = [Decimal(value) for value in row]
            top = max(logits)
            weights = [(value - top).exp() for value in logits]
            total, coefficient = sum(weights), sum(Decimal(g) for g in row_grad)
            gradient = [-coefficient * weight / total for weight in weights]
            for column, g in zip(row_ids, row_grad, strict=True):
                gradient[column] += Decimal(g)
            exact.append(gradient)
    return exact


def largest_error(gradient: torch.Tensor, exact: list[list[Decimal]]) -> float:
    return float(
        max(
            abs(Decimal(value) - want)
            for row, want_row in zip(gradient.tolist(), exact, strict=True)
            for value, want in zip(row, want_row, strict=True)
        )
    )


def extreme_ratio_problem(
    dtype: torch.dtype, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """64 positions whose 4-id head holds all but ~1e-6 of p (its logits 20 above the rest, all shifted
    by `offset`), and the gradient the sc objective sends into log p(ids) there: for the sampled id
    (column 0) -A, for each head id +A c_v with c_v = q_v - rho p_v, rho = 6.6e5 (q's tail 0.66 over
    p's ~1e-6), A = 2.5, so sum_m g_m ~ -1.6e6 multiplies p in the backward."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab, head_size, rho, advantage = 64, 40, 4, 6.6e5, 2.5
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 4.0 + offset
    head = torch.stack([torch.randperm(vocab, generator=gen)[:head_size] for _ in range(rows)])
    z.scatter_(1, head, z.gather(1, head) + 20.0)
    z = z.to(dtype)
    p_head = torch.softmax(z.double(), dim=1).gather(1, head)
    q_head = torch.rand(rows, head_size, generator=gen, dtype=torch.float64)
    q_head = q_head / q_head.sum(dim=1, keepdim=True) * 0.34
    ids = torch.cat([head[:, :1], head], dim=1)  # the objective's layout: the sampled id, then the head
    grad_out = torch.cat(
        [torch.full((rows, 1), -advantage, dtype=torch.float64), advantage * (q_head - rho * p_head)], 1
    )
    return z, ids, grad_out.to(dtype)


@pytest.mark.parametrize("chunk_vocab", [8192, 7])
@pytest.mark.parametrize("offset", [0.0, 30.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fused_backward_is_as_accurate_as_the_softmax_form_at_an_extreme_ratio(
    dtype, offset, chunk_vocab
):
    """Issue 39: the fused backward formed p as exp(z - lse), whose rounding of lse (eps |lse|) exp turns
    into a relative error of p, which the row's coefficient (~1.6e6 here) multiplies: its logit gradient
    was 8-16 eps |sum g| from exact, the softmax form's (torch.softmax: exp(z - max) / S) 1-2. Both
    against exact arithmetic: each within 3 eps |sum g| (the result's own terms g_m and (sum g) p_u
    round by ~eps |sum g| each), and the fused one at most eps |sum g| above the softmax form's. The
    logits are z = I @ W.T with W = z.T, exact, and so is W's gradient: it IS the logits' gradient."""
    z, ids, grad_out = extreme_ratio_problem(dtype, offset)
    exact = exact_logit_gradient(z, ids, grad_out)
    unit = torch.finfo(dtype).eps * float(grad_out.double().sum(dim=1).abs().max())

    logits = z.clone().requires_grad_(True)
    log_p, _, _ = log_softmax_at(logits, ids)
    log_p.backward(grad_out)
    softmax_error = largest_error(logits.grad, exact)

    hidden = torch.eye(z.shape[0], dtype=dtype).requires_grad_(True)
    weight = z.T.clone().requires_grad_(True)
    fused_log_p, _, _ = fused_log_softmax_at(hidden, weight, ids, chunk_vocab=chunk_vocab)
    if (
        chunk_vocab >= z.shape[1]
    ):  # one tile: the same forward (and lse) as the softmax form, only backward differs
        assert torch.equal(fused_log_p.detach(), log_p.detach())
    fused_log_p.backward(grad_out)
    fused_error = largest_error(weight.grad.T, exact)

    assert softmax_error <= 3 * unit, (softmax_error / unit, "the reference form itself")
    assert fused_error <= 3 * unit, (fused_error / unit, softmax_error / unit)
    assert fused_error <= softmax_error + unit, (fused_error / unit, softmax_error / unit)
