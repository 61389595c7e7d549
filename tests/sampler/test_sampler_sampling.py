"""The reference sampler's sampling step against SGLang 0.5.23's own `Sampler.forward` (the pytorch
sampling backend, which SGLang selects wherever FlashInfer is absent), run on CPU on the same logits:
kept sets, their order, support and selected logprobs, output and top logprobs agree to 1e-6 (in fact
bit for bit) over top-k / top-p / min-p / temperature grids, mixed and all-greedy batches.

Stubbed, because it cannot exist here: SGLang's process-wide parallel state. The Sampler is built with
`__new__` and given the attributes its `__init__` would read from it (no TP group, no deterministic
inference, no RL on-policy target), and `get_exec()` answers `sampling_backend="pytorch"`. Everything
the forward computes is SGLang's code. The draw is the one deliberate difference (our per-request
generator vs SGLang's global one), so SGLang's sampled token is looked up in our capture."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from rlfleet.sampler import sampling as sampling_mod
from rlfleet.sampler.sampling import TOP_K_ALL, MaskStatus, RowParams, sample

CAP = 4096


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture
def sglang_forward(monkeypatch):
    """SGLang's Sampler.forward on CPU -> (token ids, token logprobs, top logprobs, mask output)."""
    from sglang.srt.layers import sampler as sglang_sampler
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.logprob_processor import OutputLogprobProcessor
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from torch import nn

    backend = {"name": "pytorch"}
    monkeypatch.setattr(
        sglang_sampler,
        "get_exec",
        lambda: types.SimpleNamespace(kernel=types.SimpleNamespace(sampling_backend=backend["name"])),
    )
    # FlashInfer / sgl_kernel are CUDA-only: their renorm kernels are our emulations, their samplers
    # draw from the support those kernels define (the composition around them is SGLang's code)
    monkeypatch.setattr(sglang_sampler, "top_k_renorm_prob", sampling_mod.top_k_renorm_prob, raising=False)
    monkeypatch.setattr(sglang_sampler, "top_p_renorm_prob", sampling_mod.top_p_renorm_prob, raising=False)

    def min_p_sampling_from_probs(probs, min_ps):
        kept = probs.masked_fill(probs < probs.max(-1).values.view(-1, 1) * min_ps.view(-1, 1), 0)
        return torch.multinomial(kept, 1).view(-1).int()

    def top_k_top_p_sampling_from_probs(probs, top_ks, top_ps, filter_apply_order):
        assert filter_apply_order == "joint"
        joint = sampling_mod.top_k_renorm_prob(probs, top_ks)
        joint = joint.masked_fill(sampling_mod.top_p_renorm_prob(probs, top_ps) <= 0, 0)
        return torch.multinomial(joint, 1).view(-1).int()

    monkeypatch.setattr(sglang_sampler, "min_p_sampling_from_probs", min_p_sampling_from_probs, raising=False)
    monkeypatch.setattr(
        sglang_sampler, "top_k_top_p_sampling_from_probs", top_k_top_p_sampling_from_probs, raising=False
    )
    sampler = sglang_sampler.Sampler.__new__(sglang_sampler.Sampler)
    nn.Module.__init__(sampler)
    sampler.tp_sync_group = sampler.cp_sync_group = sampler.rl_on_policy_target = None
    sampler.enable_deterministic = sampler.use_log_softmax_logprob = sampler.use_ascend_backend = False
    sampler.output_logprob_processor = OutputLogprobProcessor()

    def run(
        logits: torch.Tensor, rows: list[RowParams], top_k_logprobs: int, seed: int, name="pytorch", cap=CAP
    ):
        backend["name"] = name
        sampler.sampling_mask_max_tokens = cap
        sps = [
            SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p)
            for r in rows
        ]
        n = len(sps)
        info = SamplingBatchInfo(
            temperatures=torch.tensor([[s.temperature] for s in sps], dtype=torch.float32),
            top_ps=torch.tensor([s.top_p for s in sps], dtype=torch.float32),
            top_ks=torch.tensor([s.top_k for s in sps], dtype=torch.int32),
            min_ps=torch.tensor([s.min_p for s in sps], dtype=torch.float32),
            is_all_greedy=all(s.top_k <= 1 for s in sps),
            is_any_greedy=any(s.top_k <= 1 for s in sps),
            need_top_p_sampling=any(s.top_p != 1.0 for s in sps),
            need_top_k_sampling=any(s.top_k != TOP_K_ALL for s in sps),
            need_min_p_sampling=any(s.min_p > 0 for s in sps),
            vocab_size=logits.shape[1],
            device="cpu",
            return_sampling_masks=[True] * n,
            return_sampling_support_logprobs=[True] * n,
            sampling_mask_batch_indices=torch.arange(n),
            sampling_support_logprobs_capture_indices=torch.arange(n),
        )  # the same construction as SamplingBatchInfo.from_schedule_batch (flags from the params)
        out = LogitsProcessorOutput(next_token_logits=logits.clone())
        torch.manual_seed(seed)
        ids = sampler.forward(
            out, info, True, [top_k_logprobs] * n, [None] * n, torch.zeros(n, dtype=torch.int64)
        )
        return (
            ids.long(),
            out.next_token_logprobs,
            out.next_token_top_logprobs_val,
            out.next_token_top_logprobs_idx,
            out.sampling_mask_output,
        )

    return run


def _logits(rng: np.random.Generator, rows: int, vocab: int, kind: str) -> torch.Tensor:
    if kind == "integer":  # exact ties, also at every cutoff
        return torch.from_numpy(rng.integers(-3, 3, (rows, vocab)).astype(np.float32))
    if kind == "peaked":  # a float32 cumsum that saturates before the tail; probabilities that underflow to 0
        x = rng.normal(0, 1, (rows, vocab)).astype(np.float32)
        x[:, : vocab // 8] += 30.0
        x[:, -3:] = -1e4
        return torch.from_numpy(x)
    return torch.from_numpy((rng.normal(0, 2.5, (rows, vocab))).astype(np.float32))


GRID = [
    RowParams(t, p, k, m)
    for t in (0.3, 0.7, 1.0, 1.5)
    for p in (0.5, 0.9, 0.95, 1.0)
    for k in (1, 2, 7, 40, 200)
    for m in (0.0, 0.05, 0.3)
]


@pytest.mark.parametrize("kind", ["normal", "integer", "peaked"])
@pytest.mark.parametrize("seed", range(4))
def test_kept_sets_and_logprobs_equal_sglangs_sampler(sglang_forward, kind, seed):
    rng = np.random.default_rng(1000 * seed + len(kind))
    vocab = int(rng.choice([37, 96, 151]))
    rows = [GRID[i] for i in rng.choice(len(GRID), 24, replace=False)]
    rows[0] = RowParams(0.0, 1.0, -1, 0.0)  # a greedy row in a sampling batch
    logits = _logits(rng, len(rows), vocab, kind)
    ids, lps, top_val, top_idx, mask = sglang_forward(logits, rows, 5, seed)
    ours = sample(
        logits, rows, [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(rows))], CAP
    )
    assert torch.equal(ours.mask_lengths, mask.lengths) and torch.equal(ours.statuses, mask.statuses)
    heads = ours.top_logprobs([5] * len(rows))
    for b in range(len(rows)):
        n = int(mask.lengths[b])
        got_ids, got_lps = ours.mask(b)
        assert got_ids == mask.token_ids[b, :n].tolist()  # same set, same order (ties included)
        assert np.allclose(got_lps, mask.support_logprobs[b, :n].numpy(), rtol=0, atol=1e-6)
        y = int(ids[b])
        assert y in got_ids  # SGLang's draw lies in our kept set
        assert (
            abs(float(ours.logprobs[b, y]) - float(lps[b])) <= 1e-6
        )  # full-vocab log q(y) before truncation
        # selected mode: SGLang's one float per token is our support logprob at its drawn token
        assert abs(got_lps[got_ids.index(y)] - float(mask.selected_logprobs[b])) <= 1e-6
        assert [h[1] for h in heads[b]] == list(top_idx[b]) and np.allclose(
            [h[0] for h in heads[b]], top_val[b], atol=1e-6
        )
        assert int(ours.token_ids[b]) in got_ids and ours.statuses[b] == MaskStatus.OK  # our own draw too
        sel = float(ours.selected_logprobs[b])
        assert abs(sel - got_lps[got_ids.index(int(ours.token_ids[b]))]) <= 1e-6
    # the SGLang-side cases the brief names hold on this path: no zero-probability token is ever kept
    probs = torch.softmax(logits / torch.tensor([[r.normalised().temperature] for r in rows]), -1)
    for b in range(len(rows)):
        assert all(float(probs[b, i]) > 0 for i in ours.mask(b)[0])


def test_all_greedy_batch_uses_raw_logits_like_sglang(sglang_forward):
    """Every row top_k <= 1: SGLang takes argmax and log_softmax of the logits WITHOUT temperature."""
    rng = np.random.default_rng(7)
    logits = _logits(rng, 3, 50, "normal")
    rows = [RowParams(0.0, 1.0, -1, 0.0), RowParams(0.5, 0.9, 1, 0.0), RowParams(1e-7, 0.3, 7, 0.2)]
    ids, lps, top_val, top_idx, mask = sglang_forward(logits, rows, 3, 0)
    ours = sample(logits, rows, [None, None, None], CAP)
    assert ours.token_ids.tolist() == ids.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(ours.logprobs.gather(1, ids.view(-1, 1)).view(-1), lps, atol=1e-6)
    assert torch.allclose(ours.logprobs, torch.log_softmax(logits, -1))  # no temperature at all
    assert ours.mask_lengths.tolist() == mask.lengths.tolist() == [1, 1, 1]
    assert [ours.mask(b) for b in range(3)] == [([int(i)], [0.0]) for i in ids]
    assert torch.equal(ours.selected_logprobs, mask.selected_logprobs)


def test_top_p_one_is_compared_on_the_pytorch_path(sglang_forward):
    """With top_p = 1 SGLang's torch path still applies `cumsum - p > top_p`: where the float32 cumsum
    reaches 1 before the tail, the tail is dropped by both (the CUDA FlashInfer path skips the filter
    when no row has top_p < 1; the reference server runs the pytorch path)."""
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(0, 10, (48, 151)).astype(np.float32))
    rows = [RowParams(1.0, 1.0, 100, 0.0)] * 48
    ids, _, _, _, mask = sglang_forward(logits, rows, 0, 0)
    ours = sample(logits, rows, [torch.Generator().manual_seed(b) for b in range(48)], CAP)
    assert ours.mask_lengths.tolist() == mask.lengths.tolist()
    assert [ours.mask(b)[0] for b in range(48)] == [
        mask.token_ids[b, : int(n)].tolist() for b, n in enumerate(mask.lengths)
    ]
    positive = torch.clamp((torch.softmax(logits, -1) > 0).sum(-1), max=100)
    assert int((mask.lengths < positive).sum()) >= 5  # the case is really exercised (rows lose their tail)


def test_draw_is_per_request_reproducible_and_follows_q():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None].expand(20_000, -1).contiguous()
    rows = [RowParams(1.0, 0.85, 4, 0.0)] * logits.shape[0]
    gen = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]
    res = sample(logits, rows, gen, CAP)
    again = sample(logits[:3], rows[:3], [torch.Generator().manual_seed(i) for i in range(3)], CAP)
    assert res.token_ids[:3].tolist() == again.token_ids.tolist()  # a request's draws ignore its batch
    counts = torch.bincount(res.token_ids, minlength=4).double() / logits.shape[0]
    q = torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95  # exclusive cumsum .95 > .85: 4th out
    assert torch.allclose(counts, q, atol=0.015) and counts[3] == 0


@pytest.mark.parametrize("seed", range(3))
def test_flashinfer_backend_keeps_what_sglangs_cuda_path_captures(sglang_forward, seed):
    """`--sampling-backend flashinfer`: SGLang's CUDA composition (joint top-k / top-p supports, each only
    when the batch needs it; sequential top-k -> top-p -> min-p with min_p > 0) on the same kernels:
    equal supports, order, logprobs and statuses, incl. ties at the top-k cutoff that exceed top_k and
    overflow the cap."""
    rng = np.random.default_rng(50 + seed)
    cap = 8
    rows = [GRID[i] for i in rng.choice(len(GRID), 20, replace=False)]
    rows[:4] = [
        RowParams(1.0, 1.0, 8, 0.0),
        RowParams(0.7, 0.9, 8, 0.0),
        RowParams(1.0, 0.95, 5, 0.1),
        RowParams(1.0, 1.0, 6, 0.3),
    ]
    logits = _logits(rng, len(rows), 64, "integer" if seed < 2 else "normal")
    for rows_now in (rows, [r for r in rows if r.top_p == 1.0 and r.min_p == 0.0]):  # a batch without top-p
        ids, lps, _, _, mask = sglang_forward(logits[: len(rows_now)], rows_now, 0, seed, "flashinfer", cap)
        gens = [torch.Generator().manual_seed(b) for b in range(len(rows_now))]
        ours = sample(logits[: len(rows_now)], rows_now, gens, cap, backend="flashinfer")
        assert ours.mask_lengths.tolist() == mask.lengths.tolist()
        overflow = (mask.statuses == MaskStatus.OVERFLOW).tolist()
        assert ours.statuses.tolist() == [MaskStatus.OVERFLOW if o else MaskStatus.OK for o in overflow]
        for b in range(len(rows_now)):
            n = int(mask.lengths[b])
            assert ours.mask(b)[0] == mask.token_ids[b, :n].tolist()
            assert np.allclose(ours.mask(b)[1], mask.support_logprobs[b, :n].numpy(), atol=1e-6)
    assert any(overflow) or seed == 2  # integer logits: ties at the cutoff grow supports past the cap
