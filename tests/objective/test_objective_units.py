"""Unit tests for the objective: primitives, bad records, metrics on hand-computable cases,
per-group / per-staleness splits, the PPO clip, config and shape errors, memory layout."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from materialized import materialized_policy_loss as policy_loss

from rlfleet.trainer.objective import ObjectiveConfig, TokenBatch
from rlfleet.trainer.objective import policy_loss as fused_policy_loss
from rlfleet.trainer.vocab_parallel import fused_log_softmax_at

DTYPE = torch.float64


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # unseeded randn below draws from here: every run sees the same numbers


def make_batch(
    logits: torch.Tensor, support: bool = True, seed: int = 0, k: int = 4, **overrides
) -> TokenBatch:
    """Candidates = k random ids per row with q from a softmax; y = first candidate."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens, vocab = logits.shape
    cand_ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(num_tokens)])
    cand_logq = torch.log_softmax(torch.randn(num_tokens, k, generator=gen, dtype=DTYPE), dim=1)
    if not support:
        cand_logq = cand_logq + math.log(0.8)
    fields = dict(
        tokens=cand_ids[:, 0].clone(),
        advantages=torch.randn(num_tokens, generator=gen, dtype=DTYPE),
        loss_mask=torch.ones(num_tokens, dtype=torch.bool),
        sampler_logprobs=cand_logq[:, 0].clone(),
        candidate_ids=cand_ids,
        candidate_logprobs=cand_logq,
        candidates_are_support=support,
    )
    fields.update(overrides)
    return TokenBatch(**fields)


def run(logits: torch.Tensor, batch: TokenBatch, config: ObjectiveConfig):
    z = logits.clone().requires_grad_(True)
    out = policy_loss(z, batch, config)
    out.loss.backward()
    return out, z.grad


def test_token_batch_select_takes_the_same_rows_of_every_per_token_field():
    """TokenBatch.select (the trainer's per-rank split, the sub-batches below): expectations by hand."""
    inf = float("inf")
    batch = TokenBatch(
        tokens=torch.tensor([10, 11, 12, 13]),
        advantages=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=DTYPE),
        loss_mask=torch.tensor([True, False, True, True]),
        sampler_logprobs=torch.tensor([-0.1, -0.2, -0.3, -0.4], dtype=DTYPE),
        candidate_ids=torch.tensor([[10, 1], [11, 2], [12, 3], [13, -1]]),
        candidate_logprobs=torch.tensor(
            [[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0], [-0.4, -inf]], dtype=DTYPE
        ),
        candidates_are_support=False,
        group_ids=torch.tensor([7, 8, 7, 9]),
        staleness=torch.tensor([0, 1, 2, 3]),
    )
    by_index = batch.select(torch.tensor([3, 0]))
    assert by_index.tokens.tolist() == [13, 10]
    assert by_index.advantages.tolist() == [0.0, 0.5]
    assert by_index.loss_mask.tolist() == [True, True]
    assert by_index.sampler_logprobs.tolist() == [-0.4, -0.1]
    assert by_index.candidate_ids.tolist() == [[13, -1], [10, 1]]
    assert by_index.candidate_logprobs.tolist() == [[-0.4, -inf], [-0.1, -2.0]]
    assert by_index.group_ids.tolist() == [9, 7] and by_index.staleness.tolist() == [3, 0]
    assert by_index.old_logprobs is None and by_index.candidates_are_support is False
    by_mask = batch.select(torch.tensor([False, True, True, False]))
    assert by_mask.tokens.tolist() == [11, 12] and by_mask.loss_mask.tolist() == [False, True]
    assert by_mask.candidate_ids.tolist() == [[11, 2], [12, 3]] and by_mask.group_ids.tolist() == [8, 7]
    assert by_mask.advantages.dtype == DTYPE and by_mask.num_tokens == 2
    assert batch.tokens.tolist() == [10, 11, 12, 13]  # the batch itself is untouched


ALL_CONFIGS = [
    ObjectiveConfig(mode=mode, replay=replay)
    for mode in ("pg", "mis", "sc", "sc_mis")
    for replay in (False, True)
]


# --- primitives -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_tokens, chunk_vocab", [(1, 1), (3, 4), (64, 64)])
def test_fused_log_softmax_at_matches_torch_and_passes_gradcheck(chunk_tokens, chunk_vocab):
    """log p, lse and entropy of softmax(h W^T / t) from tiles equal torch's on the whole logits, and
    the hand-written backward (both inputs, with and without the normaliser) passes gradcheck."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(7, 5, generator=gen, dtype=DTYPE).requires_grad_(True)
    w = torch.randn(11, 5, generator=gen, dtype=DTYPE).requires_grad_(True)
    ids = torch.randint(0, 11, (7, 3), generator=gen)
    kw = dict(temperature=0.7, chunk_tokens=chunk_tokens, chunk_vocab=chunk_vocab)
    log_p, lse, entropy = fused_log_softmax_at(h, w, ids, **kw)
    z = h @ w.T / 0.7
    reference = torch.log_softmax(z, 1)
    assert torch.allclose(log_p, reference.gather(1, ids), atol=1e-13)
    assert torch.allclose(lse, torch.logsumexp(z, 1), atol=1e-13)
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(1), atol=1e-13)
    assert torch.allclose(
        fused_log_softmax_at(h, w, ids, normalise=False, **kw)[0], z.gather(1, ids), atol=1e-13
    )
    assert torch.autograd.gradcheck(lambda a, b: fused_log_softmax_at(a, b, ids, **kw)[0], (h, w))
    assert torch.autograd.gradcheck(
        lambda a, b: fused_log_softmax_at(a, b, ids, normalise=False, **kw)[0], (h, w)
    )


def test_bf16_logits_are_reduced_in_float32_and_get_a_bf16_gradient():
    logits = torch.randn(6, 50, dtype=torch.float32)
    batch = make_batch(logits)
    config = ObjectiveConfig(mode="sc_mis")
    out32, grad32 = run(logits, batch, config)
    out16, grad16 = run(logits.to(torch.bfloat16), batch, config)
    assert grad16.dtype == torch.bfloat16
    assert abs(float(out16.loss.detach()) - float(out32.loss.detach())) < 0.05
    assert torch.allclose(grad16.float(), grad32, atol=2e-2)


# --- bad records ------------------------------------------------------------------------------


def corrupt(batch: TokenBatch) -> tuple[TokenBatch, torch.Tensor]:
    """Rows 1..7 each carry one kind of bad record; returns the batch and the bool mask of bad rows."""
    tokens, logq_y = batch.tokens.clone(), batch.sampler_logprobs.clone()
    cand_ids, cand_logq = batch.candidate_ids.clone(), batch.candidate_logprobs.clone()
    advantages = batch.advantages.clone()
    logq_y[1] = float("nan")  # NaN log q(y)
    logq_y[2] = float("-inf")  # q(y) = 0
    cand_ids[3, 0] = -1  # sampled token no longer in the support
    cand_ids[4, :] = -1  # empty support
    cand_logq[5, 2] = float("nan")  # NaN candidate log q
    cand_ids[6, 2] = cand_ids[6, 1]  # duplicate candidate
    advantages[7] = float("inf")  # non-finite advantage
    bad = torch.zeros(len(tokens), dtype=torch.bool)
    bad[1:8] = True
    corrupted = TokenBatch(
        tokens=tokens,
        advantages=advantages,
        loss_mask=batch.loss_mask,
        sampler_logprobs=logq_y,
        candidate_ids=cand_ids,
        candidate_logprobs=cand_logq,
        candidates_are_support=True,
    )
    return corrupted, bad


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_bad_records_are_excluded_and_counted(config):
    logits = torch.randn(10, 12, dtype=DTYPE)
    batch, bad = corrupt(make_batch(logits))
    out, grad = run(logits, batch, config)
    clean_out, clean_grad = run(logits[~bad], batch.select(~bad), config)
    assert out.metrics["invalid_tokens"] == 7.0
    assert out.num_valid_tokens == 3 and out.metrics["num_tokens"] == 3.0
    assert torch.isfinite(out.loss) and math.isclose(out.loss.item(), clean_out.loss.item(), abs_tol=1e-12)
    assert torch.all(grad[bad] == 0.0)
    # the mean is over the 3 valid tokens, not the 10 rows
    assert torch.allclose(grad[~bad], clean_grad, atol=1e-12)


def test_out_of_range_ids_are_invalid_not_a_crash():
    logits = torch.randn(3, 6, dtype=DTYPE)
    batch = make_batch(logits, support=False)
    batch.candidate_ids[0, 1] = 6  # == V
    batch.tokens[1] = 99
    out, grad = run(logits, batch, ObjectiveConfig(mode="sc"))
    assert out.metrics["invalid_tokens"] == 2.0 and torch.all(grad[:2] == 0)


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_all_invalid_gives_a_zero_loss_still_connected_to_the_logits(config):
    logits = torch.randn(4, 9, dtype=DTYPE)
    batch = make_batch(logits, sampler_logprobs=torch.full((4,), float("nan"), dtype=DTYPE))
    out, grad = run(logits, batch, config)
    assert out.loss.grad_fn is not None and out.loss.item() == 0.0
    assert torch.all(grad == 0.0)
    assert out.metrics == {"num_tokens": 0.0, "invalid_tokens": 4.0}


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_non_finite_trainer_logits_invalidate_only_their_row(config):
    logits = torch.randn(5, 9, dtype=DTYPE)
    batch = make_batch(logits)
    broken = logits.clone()
    broken[2, 5] = float("nan")
    out, grad = run(broken, batch, config)
    keep = torch.tensor([True, True, False, True, True])
    clean_out, _ = run(logits[keep], batch.select(keep), config)
    assert out.metrics["invalid_tokens"] == 1.0
    assert torch.isfinite(grad).all() and torch.all(grad[2] == 0)
    assert math.isclose(out.loss.item(), clean_out.loss.item(), abs_tol=1e-12)


def test_loss_masked_tokens_are_ignored_not_invalid():
    logits = torch.randn(4, 9, dtype=DTYPE)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=DTYPE)
    batch = make_batch(logits, loss_mask=mask)
    batch.sampler_logprobs[1] = float("nan")  # a bad record under the mask is not counted
    out, grad = run(logits, batch, ObjectiveConfig())
    assert out.metrics["invalid_tokens"] == 0.0 and out.num_valid_tokens == 3
    assert torch.all(grad[1] == 0)
    assert math.isclose(out.loss.item(), out.loss_sum.item() / 3, rel_tol=1e-14)


# --- metrics ----------------------------------------------------------------------------------


def test_metrics_when_trainer_equals_sampler():
    """Replay with logits = log q + const on the support: p_S = q exactly."""
    q = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0]], dtype=DTYPE)
    ids = torch.tensor([[4, 1, 7], [0, 2, 3]])
    logits = torch.full((2, 8), -3.0, dtype=DTYPE)
    logits.scatter_(1, ids, q.log().clamp(min=-50) + 1.7)
    logq = q.log()
    batch = TokenBatch(
        tokens=torch.tensor([1, 2]),
        advantages=torch.tensor([1.0, -1.0], dtype=DTYPE),
        loss_mask=torch.ones(2, dtype=torch.bool),
        sampler_logprobs=torch.tensor([math.log(0.3), math.log(0.4)], dtype=DTYPE),
        candidate_ids=ids,
        candidate_logprobs=logq,
        candidates_are_support=True,
    )
    out, _ = run(logits, batch, ObjectiveConfig(mode="sc_mis", replay=True))
    m = out.metrics
    assert abs(m["kl_k3"]) < 1e-12 and abs(m["logprob_abs_diff"]) < 1e-12
    assert m["oor_fraction"] == 0.0 and math.isclose(m["ess"], 1.0, abs_tol=1e-12)
    assert abs(m["sc_correction"]) < 1e-12
    entropies = [
        -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)),
        -(0.6 * math.log(0.6) + 0.4 * math.log(0.4)),
    ]
    assert math.isclose(m["entropy"], sum(entropies) / 2, abs_tol=1e-9)


def test_ratio_metrics_on_known_ratios():
    """Two tokens with r = 2 and r = 0.1 (log q(y) set from the trainer's own log p(y))."""
    logits = torch.tensor([[0.3, -1.0, 0.5, -2.0, 1.0, 0.0], [0.0, 0.2, -0.4, 1.0, 0.7, -3.0]], dtype=DTYPE)
    log_p = torch.log_softmax(logits, 1)
    tokens = torch.tensor([3, 5])  # p(y) small enough that q(y) = p(y) / r stays a probability
    ratios = [2.0, 0.1]
    log_q_y = log_p[[0, 1], tokens] - torch.tensor(ratios, dtype=DTYPE).log()
    batch = TokenBatch(
        tokens=tokens,
        advantages=torch.ones(2, dtype=DTYPE),
        loss_mask=torch.ones(2, dtype=torch.bool),
        sampler_logprobs=log_q_y,
        candidate_ids=tokens[:, None].clone(),
        candidate_logprobs=log_q_y[:, None].clone(),
        candidates_are_support=False,
    )
    out, _ = run(logits, batch, ObjectiveConfig(mode="mis"))
    m = out.metrics
    assert math.isclose(m["kl_k3"], sum((r - 1) - math.log(r) for r in ratios) / 2, rel_tol=1e-12)
    assert m["oor_low"] == 0.5 and m["oor_high"] == 0.0 and m["oor_fraction"] == 0.5
    assert math.isclose(m["logprob_abs_diff"], (math.log(2) + math.log(10)) / 2, rel_tol=1e-12)
    assert math.isclose(m["ess"], 2.1**2 / (2 * (4 + 0.01)), rel_tol=1e-12)
    p = torch.softmax(logits, 1)
    assert math.isclose(m["entropy"], float(-(p * p.log()).sum(1).mean()), rel_tol=1e-12)
    # rho = (1 - q_H) / (1 - p_H) with the head being y alone
    p_y, q_y = p[[0, 1], tokens], log_q_y.exp()
    rho = (1 - q_y) / (1 - p_y)
    assert math.isclose(m["sc_tail_ratio"], float(rho.mean()), rel_tol=1e-12)
    assert math.isclose(m["sc_tail_ratio_max"], float(rho.max()), rel_tol=1e-12)
    # mis: the out-of-band token (r = 0.1) contributes nothing; the other has weight 2
    assert math.isclose(out.loss.item(), -(2.0 * float(log_p[0, 3])) / 2, rel_tol=1e-12)


def test_sc_correction_is_twice_the_total_variation_under_replay():
    q = torch.tensor([[0.7, 0.2, 0.1]], dtype=DTYPE)
    logits = torch.zeros(1, 5, dtype=DTYPE)  # p_S uniform on the support
    batch = TokenBatch(
        tokens=torch.tensor([0]),
        advantages=torch.ones(1, dtype=DTYPE),
        loss_mask=torch.ones(1, dtype=torch.bool),
        sampler_logprobs=q[:, 0].log(),
        candidate_ids=torch.tensor([[0, 1, 2]]),
        candidate_logprobs=q.log(),
        candidates_are_support=True,
    )
    out, _ = run(logits, batch, ObjectiveConfig(mode="sc", replay=True))
    assert math.isclose(out.metrics["sc_correction"], float((q - 1 / 3).abs().sum()), rel_tol=1e-12)


def test_single_token_support_counts_one_token_supports_in_support_mode_only():
    """Rows with supports of 1, 3 (one id padded out with -1) and 1 token, the middle one with a q = 0
    candidate that does not count: 2 of 3 tokens; head mode has no such metric."""
    logits = torch.zeros(3, 6, dtype=DTYPE)
    ninf = float("-inf")
    ids = torch.tensor([[4, -1, -1, -1], [0, 1, 2, 5], [3, 1, -1, -1]])
    logq = torch.tensor(
        [
            [0.0, ninf, ninf, ninf],
            [math.log(0.5), math.log(0.3), math.log(0.2), ninf],
            [0.0, ninf, ninf, ninf],
        ],
        dtype=DTYPE,
    )
    batch = TokenBatch(
        tokens=ids[:, 0].clone(),
        advantages=torch.tensor([1.0, -1.0, -2.0], dtype=DTYPE),
        loss_mask=torch.ones(3, dtype=torch.bool),
        sampler_logprobs=logq[:, 0].clone(),
        candidate_ids=ids,
        candidate_logprobs=logq,
        candidates_are_support=True,
    )
    for config in (ObjectiveConfig(mode="sc_mis", replay=True), ObjectiveConfig(mode="pg")):
        out, grad = run(logits, batch, config)
        assert out.metrics["num_tokens"] == 3 and math.isclose(out.metrics["single_token_support"], 2 / 3)
        if config.replay:  # the two one-token rows get no gradient at all, the other one does
            assert torch.all(grad[[0, 2]] == 0.0) and bool(grad[1].abs().sum() > 0)
    head = make_batch(torch.randn(3, 6, dtype=DTYPE), support=False)
    out, _ = run(torch.randn(3, 6, dtype=DTYPE), head, ObjectiveConfig(mode="sc_mis"))
    assert "single_token_support" not in out.metrics


def test_per_group_and_per_staleness_metrics_equal_sub_batch_metrics():
    logits = torch.randn(12, 10, dtype=DTYPE)
    staleness = torch.tensor([0, 1, 2, 3, 4, 5, 6, 100, 0, 2, 7, 1])
    groups = torch.tensor([5, 5, 9, 9, 9, 5, 2, 2, 5, 9, 2, 5])
    batch = make_batch(logits, group_ids=groups, staleness=staleness)
    batch.sampler_logprobs[0] = float("nan")  # one invalid token, in group 5 and bucket 0-1
    config = ObjectiveConfig(mode="sc_mis")
    out, _ = run(logits, batch, config)
    assert set(out.per_group) == {2, 5, 9}
    assert set(out.per_staleness) == {"0-1", "2-3", "4-5", "6+"}
    expected_buckets = {"0-1": [0, 1, 8, 11], "2-3": [2, 3, 9], "4-5": [4, 5], "6+": [6, 7, 10]}
    for name, rows in expected_buckets.items():
        keep = torch.zeros(12, dtype=torch.bool)
        keep[rows] = True
        sub, _ = run(logits[keep], batch.select(keep), config)
        assert out.per_staleness[name].keys() == sub.metrics.keys()
        assert all(
            math.isclose(out.per_staleness[name][k], sub.metrics[k], abs_tol=1e-12) for k in sub.metrics
        )
    for group in (2, 5, 9):
        keep = groups == group
        sub, _ = run(logits[keep], batch.select(keep), config)
        assert all(math.isclose(out.per_group[group][k], sub.metrics[k], abs_tol=1e-12) for k in sub.metrics)
    assert out.per_group[5]["invalid_tokens"] == 1.0 and out.per_staleness["0-1"]["invalid_tokens"] == 1.0


# --- PPO clip ---------------------------------------------------------------------------------


def test_ppo_clip_is_neutral_on_the_first_pass():
    logits = torch.randn(6, 9, dtype=DTYPE)
    batch = make_batch(logits)
    for replay in (False, True):
        plain, plain_grad = run(logits, batch, ObjectiveConfig(mode="sc_mis", replay=replay))
        # p_old = the current policy, normalised as the loss normalises (inside S under replay); y is
        # the first candidate, so log p_S(y) is column 0 of the support's log-softmax.
        if replay:
            log_p_old = torch.log_softmax(logits.gather(1, batch.candidate_ids), 1)[:, 0]
        else:
            log_p_old = torch.log_softmax(logits, 1)[torch.arange(6), batch.tokens]
        batch.old_logprobs = log_p_old.clone()
        clipped, clipped_grad = run(
            logits, batch, ObjectiveConfig(mode="sc_mis", replay=replay, ppo_clip=True)
        )
        assert torch.allclose(plain_grad, clipped_grad, atol=1e-12)
        assert clipped.metrics["ppo_clip_fraction"] == 0.0


def test_ppo_clip_stops_the_sampled_token_gradient_outside_the_trust_region():
    logits = torch.randn(2, 7, dtype=DTYPE)
    log_p = torch.log_softmax(logits, 1)
    tokens = torch.tensor([1, 4])
    log_p_y = log_p[[0, 1], tokens]
    # s = p / p_old = 2: above 1 + 0.28. With A > 0 the clipped branch wins (no gradient);
    # with A < 0 the unclipped one does (gradient A s grad log p(y)).
    batch = TokenBatch(
        tokens=tokens,
        advantages=torch.tensor([1.0, -1.0], dtype=DTYPE),
        loss_mask=torch.ones(2, dtype=torch.bool),
        sampler_logprobs=log_p_y.clone(),
        candidate_ids=tokens[:, None].clone(),
        candidate_logprobs=log_p_y[:, None].clone(),
        candidates_are_support=False,
        old_logprobs=log_p_y - math.log(2.0),
    )
    out, grad = run(logits, batch, ObjectiveConfig(mode="pg", ppo_clip=True))
    assert out.metrics["ppo_clip_fraction"] == 0.5
    assert torch.all(grad[0] == 0)
    advantage, s = -1.0, 2.0  # token mean over the 2 tokens: d loss = -(A s / 2) grad log p(y)
    expected = -(advantage * s / 2) * (torch.nn.functional.one_hot(tokens[1], 7) - log_p[1].exp())
    assert torch.allclose(grad[1], expected, atol=1e-12)


# --- config and shape errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="grpo"), "mode must be one of"),
        (dict(mis_low=5.0, mis_high=0.2), "mis_low < mis_high"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(clip_eps_low=1.5), "clip_eps_low"),
    ],
)
def test_bad_config_is_a_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObjectiveConfig(**kwargs)


def test_correction_modes_map_to_configs():
    assert ObjectiveConfig.from_correction("sc-mis-topp", mis_low=0.5) == ObjectiveConfig(
        mode="sc_mis", replay=True, mis_low=0.5
    )
    assert ObjectiveConfig.from_correction("none").mode == "pg"
    with pytest.raises(ValueError, match="unknown correction mode"):
        ObjectiveConfig.from_correction("icepop")


def test_inconsistent_batch_is_a_clear_value_error():
    logits = torch.randn(3, 6, dtype=DTYPE)
    with pytest.raises(ValueError, match="replay=True needs candidates_are_support"):
        policy_loss(logits, make_batch(logits, support=False), ObjectiveConfig(replay=True))
    with pytest.raises(ValueError, match=r"batch.advantages must have shape \[T\]"):
        policy_loss(logits, make_batch(logits, advantages=torch.ones(4, dtype=DTYPE)), ObjectiveConfig())
    with pytest.raises(ValueError, match="candidate_logprobs"):
        policy_loss(
            logits, make_batch(logits, candidate_logprobs=torch.zeros(3, 2, dtype=DTYPE)), ObjectiveConfig()
        )
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logits, make_batch(logits), ObjectiveConfig(ppo_clip=True))
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        policy_loss(logits, make_batch(logits, staleness=torch.tensor([0, -1, 2])), ObjectiveConfig())
    with pytest.raises(ValueError, match=r"hidden must be \[T, H\]"):
        fused_policy_loss(logits[None], torch.eye(6, dtype=DTYPE), make_batch(logits), ObjectiveConfig())
    with pytest.raises(ValueError, match="hidden size 6 != the output weight's 5"):
        fused_policy_loss(logits, torch.ones(6, 5, dtype=DTYPE), make_batch(logits), ObjectiveConfig())


# --- memory layout ----------------------------------------------------------------------------


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=str)
def test_no_vocabulary_sized_tensor_is_saved_for_backward(config):
    """The fused lm_head + objective keeps the caller's hidden states and weight for backward and
    nothing of size [T, V] besides: no logits, no softmax, no log-softmax, no dense q."""
    num_tokens, vocab, hidden_size, k = 16, 4096, 8, 8
    hidden = torch.randn(num_tokens, hidden_size, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float32, requires_grad=True)
    batch = make_batch(torch.randn(num_tokens, vocab), k=k, support=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_policy_loss(hidden, weight, batch, replace(config, chunk_tokens=4, chunk_vocab=512))
    inputs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}
    others = [t for t in saved if t.untyped_storage().data_ptr() not in inputs]
    assert max((t.numel() for t in others), default=0) <= num_tokens * (k + 1), [
        tuple(t.shape) for t in others
    ]
    out.loss.backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
