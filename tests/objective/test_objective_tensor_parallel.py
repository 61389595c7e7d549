"""Vocabulary-parallel `policy_loss` (the fused lm_head): two real gloo processes on CPU, float64.

Each rank holds half of the output embedding's rows (the vocabulary); loss, metrics, the gradient of
its weight shard and the hidden states' gradient summed over the ranks must equal the unsharded
computation (done in the same process) within 1e-10, in every mode, with padding and invalid records.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.ports import free_port

from rlfleet.trainer.objective import ObjectiveConfig, TokenBatch, policy_loss

WORLD = 2
DTYPE = torch.float64


def problem(
    seed: int, support: bool, num_tokens: int = 13, vocab: int = 18, k: int = 5, hidden_size: int = 6
):
    """(hidden [T, H], output weight [V, H], batch) with padding and one invalid record of each kind."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen, dtype=DTYPE)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=DTYPE) * 2.0 / hidden_size**0.5
    cand_ids = torch.stack([torch.randperm(vocab - 1, generator=gen)[:k] for _ in range(num_tokens)])
    cand_logq = torch.log_softmax(torch.randn(num_tokens, k, generator=gen, dtype=DTYPE), dim=1)
    if not support:  # a head of a full-vocabulary q: mass < 1
        cand_logq = cand_logq + torch.log(torch.rand(num_tokens, 1, generator=gen, dtype=DTYPE) * 0.5 + 0.4)
    cand_ids[0, 3:] = -1  # padding
    cand_logq[0, 3:] = float("-inf")
    pick = torch.randint(0, 3, (num_tokens,), generator=gen)
    tokens = cand_ids.gather(1, pick[:, None])[:, 0]
    sampler_logprobs = cand_logq.gather(1, pick[:, None])[:, 0]
    sampler_logprobs[1] = float("nan")  # invalid record
    tokens[2] = cand_ids[2, 4] if support else tokens[2]
    if support:
        cand_ids[2, 4] = -1  # sampled token outside its support
    else:
        cand_ids[2, 4] = cand_ids[2, 3]  # duplicate candidate id
    return (
        hidden,
        weight,
        TokenBatch(
            tokens=tokens,
            advantages=torch.randn(num_tokens, generator=gen, dtype=DTYPE),
            loss_mask=torch.tensor([True] * (num_tokens - 1) + [False]),
            sampler_logprobs=sampler_logprobs,
            candidate_ids=cand_ids,
            candidate_logprobs=cand_logq,
            candidates_are_support=support,
            group_ids=torch.arange(num_tokens) % 3,
            staleness=torch.arange(num_tokens),
            old_logprobs=sampler_logprobs + 0.3 * torch.randn(num_tokens, generator=gen, dtype=DTYPE),
        ),
    )


CASES = [
    (mode, support, replay, ppo)
    for mode in ("pg", "mis", "sc", "sc_mis")
    for support, replay in ((True, True), (True, False), (False, False))
    for ppo in (False, True)
]


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(abs(a[key] - b[key]) <= 1e-10 for key in a)


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        failures = []
        for seed, (mode, support, replay, ppo) in enumerate(CASES):
            hidden, weight, batch = problem(seed, support)
            config = ObjectiveConfig(mode=mode, replay=replay, ppo_clip=ppo, chunk_tokens=4, chunk_vocab=4)
            h_full, w_full = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            reference = policy_loss(h_full, w_full, batch, config, temperature=0.8)
            reference.loss.backward()
            local = weight.shape[0] // WORLD
            h = hidden.clone().requires_grad_(True)
            w = weight[rank * local : (rank + 1) * local].clone().requires_grad_(True)
            sharded = policy_loss(h, w, batch, config, process_group=dist.group.WORLD, temperature=0.8)
            sharded.loss.backward()
            grad_hidden = h.grad.clone()
            dist.all_reduce(
                grad_hidden
            )  # each shard's partial sum: the caller's reduction (megatron's mapping)
            grad_error = max(
                float((w.grad - w_full.grad[rank * local : (rank + 1) * local]).abs().max()),
                float((grad_hidden - h_full.grad).abs().max()),
            )
            loss_error = abs(float(sharded.loss.detach()) - float(reference.loss.detach()))
            full = w_full  # the gradient check below
            case = f"rank {rank} {mode} support={support} replay={replay} ppo={ppo}"
            if reference.metrics["invalid_tokens"] < 2 or full.grad.abs().max() == 0:
                failures.append(f"{case}: the problem does not exercise invalid records / gradients")
            if loss_error > 1e-10 or grad_error > 1e-10:
                failures.append(f"{case}: loss error {loss_error:.3g}, grad error {grad_error:.3g}")
            if not (
                _close(sharded.metrics, reference.metrics)
                and sharded.per_group.keys() == reference.per_group.keys()
                and all(_close(sharded.per_group[g], reference.per_group[g]) for g in reference.per_group)
                and all(
                    _close(sharded.per_staleness[b], reference.per_staleness[b])
                    for b in reference.per_staleness
                )
            ):
                failures.append(f"{case}: metrics differ")
        assert not failures, "\n".join(failures)
    finally:
        dist.destroy_process_group()


def test_sharded_loss_and_gradient_equal_unsharded():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
