"""SGLang's sampling rule, pinned by properties: the kept set is exactly top-k ∩ exclusive-cumsum top-p
∩ min-p on the sorted post-temperature distribution, the returned q is renormalised on it, and the
sampled token is drawn from exactly that q."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.sampler.sampling import RowParams, sample


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def reference_kept(logits: np.ndarray, p: RowParams) -> np.ndarray:
    """Plain restatement (float64, per row): which sorted ranks SGLang keeps."""
    if p.temperature < 1e-6:
        p = RowParams(1.0, p.top_p, 1, p.min_p)
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    ps = probs[order]
    k = p.top_k if p.top_k > 0 else len(ps)
    keep = (np.arange(len(ps)) < k) & ((np.cumsum(ps) - ps) <= p.top_p) & (ps >= ps[0] * p.min_p)
    return order[keep]


params_st = st.builds(
    RowParams,
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.floats(0.05, 1.0),
    top_k=st.sampled_from([-1, 1, 2, 5, 17]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    vocab=st.integers(2, 40),
    rows=st.lists(params_st, min_size=1, max_size=4),
    integer_logits=st.booleans(),
)
def test_kept_set_renormalisation_and_draw(seed, vocab, rows, integer_logits):
    rng = np.random.default_rng(seed)
    # integer logits create exact ties, also at the cutoffs
    logits = (
        rng.integers(-3, 3, (len(rows), vocab)).astype(np.float32)
        if integer_logits
        else rng.normal(0, 2, (len(rows), vocab)).astype(np.float32)
    )
    u = torch.tensor(rng.uniform(0, 1, len(rows)), dtype=torch.float32)
    res = sample(torch.from_numpy(logits), rows, u)
    for b, p in enumerate(rows):
        m = int(res.kept[b])
        ids = res.sorted_ids[b, :m].numpy()
        ref = reference_kept(logits[b], p)
        if integer_logits or p.top_p == 1.0:
            assert ids.tolist() == ref.tolist()
        else:  # float32 vs float64 cumsums may disagree only for a token sitting on the top_p boundary
            assert (
                abs(len(ids) - len(ref)) <= 1
                and ids[: min(len(ids), len(ref))].tolist() == ref[: min(len(ids), len(ref))].tolist()
            )
        lq = res.kept_logprobs[b, :m].double()
        assert abs(torch.logsumexp(lq, 0).item()) < 1e-5  # q_S sums to 1 on S
        assert torch.isinf(res.kept_logprobs[b, m:]).all()  # and is 0 outside S
        assert (lq[:-1] >= lq[1:] - 1e-6).all()  # sorted by probability
        y, pos = int(res.token_ids[b]), int(res.sampled_rank[b])
        assert 0 <= pos < m and int(res.sorted_ids[b, pos]) == y  # drawn from inside S
        cdf = torch.cumsum(lq.exp(), 0)
        lo = 0.0 if pos == 0 else cdf[pos - 1].item()
        assert lo - 1e-6 <= u[b].item() * cdf[-1].item() <= cdf[pos].item() + 1e-6  # inverse CDF of q_S
        t = 1.0 if p.temperature < 1e-6 else p.temperature
        full = torch.log_softmax(torch.from_numpy(logits[b]).double() / t, 0)
        assert abs(res.logprobs[b].item() - full[y].item()) < 1e-5  # full-vocab log q(y) before truncation
        if p.temperature == 0.0:
            assert m == 1 and y == int(np.argmax(logits[b]))


def test_crossing_token_is_kept_and_empirical_frequencies_match_q():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None]
    # exclusive cumsums 0, .5, .8, .95: top_p = 0.6 keeps ranks 0,1 (the crossing token at rank 1 too)
    res = sample(logits, [RowParams(1.0, 0.6, -1, 0.0)], torch.tensor([0.0]))
    assert int(res.kept[0]) == 2
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    uniforms = torch.rand(n, generator=gen)
    res = sample(logits.expand(n, -1), [RowParams(1.0, 0.85, -1, 0.0)] * n, uniforms)
    counts = torch.bincount(res.token_ids, minlength=4).double() / n
    q = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert torch.allclose(counts, q.double(), atol=0.015)
    assert counts[3] == 0  # outside the support: never sampled
