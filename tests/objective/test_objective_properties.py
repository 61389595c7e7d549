"""Property tests pinning the identities of docs/method.md exactly, in float64.

One generated position per example: trainer logits z [V], a sampler support S with q on it (or a
head H of a full-vocabulary q). Expectations over y ~ q are computed EXACTLY by enumerating every y
with q(y) > 0, calling `policy_loss` on a one-token batch and weighting the autograd gradient by q(y).
"""

from __future__ import annotations

import math

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from materialized import materialized_policy_loss as policy_loss

from rlfleet.trainer.objective import ObjectiveConfig, TokenBatch

DTYPE = torch.float64
FAST = settings(max_examples=40, deadline=None)


@st.composite
def positions(draw, min_vocab: int = 2, max_vocab: int = 9):
    """(logits [V], support ids (random order), q over the support [k] summing to 1, padding columns)."""
    vocab = draw(st.integers(min_vocab, max_vocab))
    logits = draw(st.lists(st.floats(-6.0, 6.0), min_size=vocab, max_size=vocab))
    order = draw(st.permutations(list(range(vocab))))
    size = draw(st.integers(1, vocab))
    weights = draw(st.lists(st.floats(0.05, 10.0), min_size=size, max_size=size))
    padding = draw(st.integers(0, 2))
    q = torch.tensor(weights, dtype=DTYPE)
    return torch.tensor(logits, dtype=DTYPE), torch.tensor(order[:size]), q / q.sum(), padding


def one_token_grad(
    logits: torch.Tensor,
    y: int,
    log_q_y: float,
    advantage: float,
    cand_ids: torch.Tensor,
    cand_logq: torch.Tensor,
    padding: int,
    support: bool,
    config: ObjectiveConfig,
) -> tuple[torch.Tensor, float]:
    """(d loss / d logits [V], loss) for a one-token batch."""
    ids = torch.cat([cand_ids, torch.full((padding,), -1)])[None, :]
    logq = torch.cat([cand_logq, torch.full((padding,), float("-inf"), dtype=DTYPE)])[None, :]
    z = logits.clone()[None, :].requires_grad_(True)
    batch = TokenBatch(
        tokens=torch.tensor([y]),
        advantages=torch.tensor([advantage], dtype=DTYPE),
        loss_mask=torch.tensor([True]),
        sampler_logprobs=torch.tensor([log_q_y], dtype=DTYPE),
        candidate_ids=ids,
        candidate_logprobs=logq,
        candidates_are_support=support,
    )
    out = policy_loss(z, batch, config)
    assert out.metrics["invalid_tokens"] == 0.0
    out.loss.backward()
    return z.grad[0], float(out.loss.detach())


def expected_grad_support(logits, support, q, padding, config, advantage_of) -> torch.Tensor:
    """sum over y in S of q(y) * grad loss(y): the exact expectation over y ~ q."""
    total = torch.zeros_like(logits)
    for y, q_y in zip(support.tolist(), q.tolist(), strict=True):
        grad, _ = one_token_grad(
            logits, y, math.log(q_y), advantage_of(y), support, q.log(), padding, True, config
        )
        total += q_y * grad
    return total


def scatter(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab, dtype=DTYPE).index_put_((ids,), values)


@FAST
@given(positions(), st.sampled_from(["sc", "sc_mis"]), st.booleans(), st.floats(-3.0, 3.0))
def test_centered_modes_have_zero_expected_gradient_under_constant_advantage(
    position, mode, replay, advantage
):
    logits, support, q, padding = position
    config = ObjectiveConfig(mode=mode, replay=replay)
    expected = expected_grad_support(logits, support, q, padding, config, lambda _y: advantage)
    assert torch.allclose(expected, torch.zeros_like(expected), atol=1e-12)


@st.composite
def head_positions(draw):
    """A head H (proper subset) of a full-vocabulary q whose tail is exactly rho * p (the tail model)."""
    logits, order, _, padding = draw(positions(min_vocab=3))
    vocab = logits.shape[0]
    head_size = draw(st.integers(1, vocab - 1))
    head = order[:head_size] if order.shape[0] >= head_size else torch.arange(head_size)
    p = torch.softmax(logits, 0)
    in_head = torch.zeros(vocab, dtype=torch.bool)
    in_head[head] = True
    p_tail = float(p[~in_head].sum())
    assume(p_tail > 1e-3)
    rho = draw(st.floats(0.001, 0.999)) / p_tail  # keeps sum_H q = 1 - rho * p_tail in (0, 1)
    head_weights = torch.tensor(
        draw(st.lists(st.floats(0.05, 10.0), min_size=head_size, max_size=head_size)), dtype=DTYPE
    )
    q = rho * p
    q[head] = head_weights / head_weights.sum() * (1.0 - rho * p_tail)
    return logits, head, q, padding


@FAST
@given(head_positions(), st.sampled_from(["sc", "sc_mis"]), st.floats(-3.0, 3.0))
def test_tail_modelled_centering_is_exact_when_the_tail_follows_the_model(position, mode, advantage):
    logits, head, q_full, padding = position
    config = ObjectiveConfig(mode=mode)
    expected = torch.zeros_like(logits)
    for y in range(logits.shape[0]):  # y ranges over the whole vocabulary, head and tail
        grad, _ = one_token_grad(
            logits, y, math.log(q_full[y]), advantage, head, q_full[head].log(), padding, False, config
        )
        expected += q_full[y] * grad
    assert torch.allclose(expected, torch.zeros_like(expected), atol=1e-11)


@FAST
@given(positions(), st.booleans())
def test_uncorrected_pg_drifts_toward_q(position, replay):
    """A = 1: E_q[grad loss] = -sum_v q(v) grad log p(v), computed independently with log_softmax."""
    logits, support, q, padding = position
    expected = expected_grad_support(
        logits, support, q, padding, ObjectiveConfig(mode="pg", replay=replay), lambda _y: 1.0
    )
    z = logits.clone().requires_grad_(True)
    if replay:  # p_S: log-softmax over the support only
        reference_loss = -(q * torch.log_softmax(z[support], 0)).sum()
    else:
        reference_loss = -(scatter(q, support, logits.shape[0]) * torch.log_softmax(z, 0)).sum()
    reference_loss.backward()
    assert torch.allclose(expected, z.grad, atol=1e-12)
    # and it is a real drift whenever q differs from p (the thing SC removes)
    p = torch.softmax(logits[support] if replay else logits, 0)
    q_vec = q if replay else scatter(q, support, logits.shape[0])
    if (p - q_vec).abs().max() > 1e-6:
        assert expected.abs().max() > 0


@st.composite
def stale_positions(draw, max_vocab: int = 9):
    """(trainer logits z [V], the trainer's logit move d [V] since the sampler's version): the sampler
    serves q = softmax(z - d), its support the whole vocabulary."""
    vocab = draw(st.integers(2, max_vocab))
    z = draw(st.lists(st.floats(-6.0, 6.0), min_size=vocab, max_size=vocab))
    d = draw(st.lists(st.floats(-2.0, 2.0), min_size=vocab, max_size=vocab))
    return torch.tensor(z, dtype=DTYPE), torch.tensor(d, dtype=DTYPE)


@FAST
@given(stale_positions(), st.sampled_from([-1.0, -0.25, 0.25, 1.0]))
def test_uncorrected_pg_on_stale_samples_keeps_moving_where_the_advantage_is_negative(position, advantage):
    """docs/objective.md, staleness: with q a stale copy of p (the trainer moved its logits by d since),
    pg's expected update under a constant advantage A is -lr A (p - q), and (p - q) . d >= 0 for every
    z, d (softmax is the gradient of the convex log-sum-exp, and gradients of a convex function are
    monotone). So where A < 0 pg moves the logits further the way they last moved (an overshoot that
    repeats every step the lag lasts), where A > 0 it pulls them back; SC's update is 0 (the
    centered-modes test above). Strict when d is not constant (then p != q)."""
    z, d = position
    vocab = z.shape[0]
    q = torch.softmax(z - d, 0)
    assume(float(q.min()) > 1e-12)
    grad = expected_grad_support(
        z, torch.arange(vocab), q, 0, ObjectiveConfig(mode="pg"), lambda _y: advantage
    )
    update = -grad  # one step of gradient descent on the loss, learning rate 1
    p = torch.softmax(z, 0)
    assert torch.allclose(update, advantage * (q - p), atol=1e-12)
    along = float(update @ d)
    spread = float(d.max() - d.min())
    if advantage < 0:
        assert along >= -1e-12
    else:
        assert along <= 1e-12
    if spread > 1e-3 and float((p - q).abs().max()) > 1e-9:
        assert abs(along) > 0


@FAST
@given(positions(), st.booleans(), st.lists(st.floats(-3.0, 3.0), min_size=9, max_size=9))
def test_mis_expectation_equals_in_band_p_weighting(position, replay, advantages):
    """E_{y~q}[f(r_y) A(y) grad log p(y)] = sum over in-band y of p(y) A(y) grad log p(y)."""
    logits, support, q, padding = position
    config = ObjectiveConfig(mode="mis", replay=replay)
    vocab = logits.shape[0]
    p_all = torch.softmax(logits[support], 0) if replay else torch.softmax(logits, 0)[support]
    ratios = p_all / q
    # the band edge is measure-zero; keep hypothesis from sitting exactly on it
    assume(all(abs(r - edge) > 1e-9 for r in ratios.tolist() for edge in (config.mis_low, config.mis_high)))
    expected = expected_grad_support(logits, support, q, padding, config, lambda y: advantages[y])
    # independent: loss gradient is -A f(r) grad log p(y); expectation = -sum_in-band p(y) A(y) (e_y - p)
    p_ref = torch.softmax(logits[support], 0) if replay else torch.softmax(logits, 0)
    reference = torch.zeros(vocab, dtype=DTYPE)
    for index, y in enumerate(support.tolist()):
        if config.mis_low <= float(ratios[index]) <= config.mis_high:
            grad_log_p = -p_ref.clone()
            if replay:
                grad_log_p = scatter(grad_log_p, support, vocab)
                grad_log_p[y] += 1.0
            else:
                grad_log_p[y] += 1.0
            reference += -float(p_all[index]) * advantages[y] * grad_log_p
    assert torch.allclose(expected, reference, atol=1e-12)


@FAST
@given(positions(), st.sampled_from(["pg", "mis", "sc", "sc_mis"]), st.floats(-3.0, 3.0))
def test_replay_touches_only_the_support_and_p_s_sums_to_one(position, mode, advantage):
    logits, support, q, padding = position
    outside = torch.ones(logits.shape[0], dtype=torch.bool)
    outside[support] = False
    log_p_s_sum = 0.0
    for y, q_y in zip(support.tolist(), q.tolist(), strict=True):
        grad, _ = one_token_grad(
            logits,
            y,
            math.log(q_y),
            advantage,
            support,
            q.log(),
            padding,
            True,
            ObjectiveConfig(mode=mode, replay=True),
        )
        assert torch.all(grad[outside] == 0.0)
        # pg with A = 1 has loss = -log p_S(y)
        _, loss = one_token_grad(
            logits,
            y,
            math.log(q_y),
            1.0,
            support,
            q.log(),
            padding,
            True,
            ObjectiveConfig(mode="pg", replay=True),
        )
        log_p_s_sum += math.exp(-loss)
    assert math.isclose(log_p_s_sum, 1.0, rel_tol=0, abs_tol=1e-12)


@FAST
@given(positions(), st.sampled_from(["sc", "sc_mis"]), st.floats(-3.0, 3.0))
def test_head_covering_the_support_equals_exact_centering(position, mode, advantage):
    """With H = S the tail model reduces to exact SC, up to the documented 1e-6 mass floor of rho
    (q's tail mass is 0, so rho = 1e-6 / max(p_tail, 1e-6)): the gradients differ by
    A alpha sum_H p_v grad log p(v), whose L1 norm is 2 |A| alpha p_H p_tail. For sc alpha = rho gives
    <= 2e-6 |A|; for sc_mis alpha = 1[rho >= 1/5] is nonzero only when p_tail <= 5e-6: <= 1e-5 |A|."""
    logits, support, q, padding = position
    config = ObjectiveConfig(mode=mode)
    p_tail = 1.0 - float(torch.softmax(logits, 0)[support].sum())
    for y, q_y in zip(support.tolist(), q.tolist(), strict=True):
        head_grad, _ = one_token_grad(
            logits, y, math.log(q_y), advantage, support, q.log(), padding, False, config
        )
        exact_grad, _ = one_token_grad(
            logits, y, math.log(q_y), advantage, support, q.log(), padding, True, config
        )
        difference = float((head_grad - exact_grad).abs().sum())
        assert difference <= (2e-6 if mode == "sc" else 1e-5) * abs(advantage) + 1e-12
        if mode == "sc_mis" and p_tail > 5e-6 + 1e-9:  # rho < 1/mis_high: alpha = 0, exactly exact SC
            assert difference <= 1e-12


@FAST
@given(positions(min_vocab=2), st.sampled_from(["pg", "mis", "sc", "sc_mis"]), st.floats(-3.0, 3.0))
def test_replay_gives_no_gradient_where_the_kept_set_is_one_token(position, mode, advantage):
    """The limit of mask replay that docs/objective.md states: where top-p keeps ONE token (its
    probability alone reaches top_p), p_S of it is 1 whatever the logits, so no advantage, however
    negative, moves that position; without replay the same sample does push the full softmax."""
    logits, support, _, padding = position
    y = int(support[0])
    kept = support[:1]
    one = torch.zeros(1, dtype=DTYPE)  # log q = 0: q is 1 on the single kept token
    grad, loss = one_token_grad(
        logits, y, 0.0, advantage, kept, one, padding, True, ObjectiveConfig(mode=mode, replay=True)
    )
    assert torch.all(grad == 0.0) and loss == 0.0
    full, _ = one_token_grad(logits, y, 0.0, advantage, kept, one, padding, True, ObjectiveConfig(mode="pg"))
    p = torch.softmax(logits, dim=0)
    expected = -advantage * (torch.nn.functional.one_hot(torch.tensor(y), logits.shape[0]).to(DTYPE) - p)
    assert torch.allclose(full, expected, atol=1e-12)  # pg without replay: -A (e_y - p), not 0
