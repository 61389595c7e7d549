"""What the transformers backend's tests (tests/trainer/test_trainer_backend_hf.py, test_trainer_routing.py,
test_trainer_routing_replay.py) step on: the tiny dense and MoE models' sizes, the objective and optimizer
the backend trains with on CPU, batches with a support of candidates per row, one step with its gradients,
and a job run in gloo processes."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from rlfleet.records import SUPPORT_MODE
from rlfleet.trainer.backends.backend_common import OptimConfig
from rlfleet.trainer.backends.backend_hf import HFBackend
from rlfleet.trainer.objective import ObjectiveConfig
from rlfleet.trainer.rollout.batching import FlatBatch
from support.gqa_sizes import TWO_LAYER_GQA

VOCAB = 96
OBJECTIVE = ObjectiveConfig(mode="sc_mis", replay=True)
OPTIM = OptimConfig(learning_rate=1e-2, max_grad_norm=1e9)  # no clipping: raw gradients are compared

SMALL_QWEN3 = {"vocab_size": VOCAB, "max_position_embeddings": 64, **TWO_LAYER_GQA}
"""A tiny Qwen3 (rlfleet/tiny_qwen3.py, via the `tiny_qwen3_factory` fixture; test_trainer_backend_hf's
`tiny_llama` too) small enough for a two-process CPU test: no fp8 view is published here, so no
128-multiples are needed."""


SMALL_MOE = dict(
    SMALL_QWEN3,
    architecture="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router_aux_loss_coef=0.5,
)
"""The project's tiny Qwen3-MoE (rlfleet/tiny_qwen3.py) at SMALL_QWEN3's sizes, 4 experts of 16, top-2; a
large load-balancing coefficient (Qwen3-MoE's is 0.001) so that the router's loss moves every gradient it
reaches by far more than the tolerance."""


def make_batch(num_seqs: int = 5, seed: int = 0, lens: list[int] | None = None) -> FlatBatch:
    """Sequences of different lengths (right-padded; `lens`, else 7..12 tokens), a 4-token prompt,
    sampled tokens after it, each with a support of 4 candidates (the sampled one included, q
    renormalised on it)."""
    rng = np.random.default_rng(seed)
    lens = np.array(lens, dtype=np.int64) if lens is not None else rng.integers(7, 13, size=num_seqs)
    num_seqs = len(lens)
    input_ids = np.zeros((num_seqs, int(lens.max())), dtype=np.int64)
    cols: dict[str, list] = {
        k: [] for k in ("seq", "pos", "tgt", "adv", "lq", "ids", "clq", "cnt", "grp", "st")
    }
    for b, n in enumerate(lens):
        input_ids[b, :n] = rng.integers(1, VOCAB, size=n)
        adv = float(rng.normal())
        for s in range(4, int(n)):
            tgt = int(input_ids[b, s])
            others = rng.choice(np.setdiff1d(np.arange(VOCAB), [tgt]), size=3, replace=False)
            ids = np.concatenate([[tgt], others])
            lq = np.log(rng.dirichlet(np.ones(4))).astype(np.float32)
            cols["seq"].append(b)
            cols["pos"].append(s - 1)
            cols["tgt"].append(tgt)
            cols["adv"].append(adv)
            cols["lq"].append(lq[0])
            cols["ids"].append(ids)
            cols["clq"].append(lq)
            cols["cnt"].append(4)
            cols["grp"].append("h100-fp8" if b % 2 else "b200-nvfp4")
            cols["st"].append(int(b % 3))
    t = len(cols["tgt"])
    offsets = np.zeros(t + 1, dtype=np.int64)
    np.cumsum(cols["cnt"], out=offsets[1:])
    lq = np.array(cols["lq"], dtype=np.float32)
    return FlatBatch(
        input_ids=input_ids,
        seq_lens=lens.astype(np.int64),
        row_seq=np.array(cols["seq"], dtype=np.int64),
        row_pos=np.array(cols["pos"], dtype=np.int64),
        target_ids=np.array(cols["tgt"], dtype=np.int64),
        advantages=np.array(cols["adv"], dtype=np.float32),
        logq=lq - 0.1,
        logq_support=lq,
        cand_offsets=offsets,
        cand_ids=np.concatenate(cols["ids"]).astype(np.int64),
        cand_logq=np.concatenate(cols["clq"]).astype(np.float32),
        candidate_mode=SUPPORT_MODE,
        versions=np.zeros(t, dtype=np.int64),
        staleness=np.array(cols["st"], dtype=np.int64),
        groups=np.array(cols["grp"], dtype=object),
    )


GROUPS = {"b200-nvfp4": 0, "h100-fp8": 1}


def cpu_backend(ckpt: str | Path, **options: Any) -> HFBackend:
    """The transformers backend on the checkpoint `ckpt` as these tests train it: OBJECTIVE and OPTIM, fp32
    on CPU (joining the process group where one is initialised); `options` are the backend's others (the
    micro-batch budget, routing replay, temperature, activation checkpointing)."""
    return HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu", **options)


RAGGED = [30, 5, 17, 9, 24, 6, 12]  # a long-tailed batch: the longest is 6x the shortest


def ragged_batch() -> FlatBatch:
    """`make_batch` of the RAGGED lengths (seed 3), the batch the micro-batch and MoE tests step on."""
    return make_batch(lens=RAGGED, seed=3)


def one_step(backend: HFBackend, flat: FlatBatch) -> dict:
    out, grad_norm = backend.train_step(flat, GROUPS)
    grads = {}
    for name, p in backend.model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {
        "loss": float(out.loss.detach()),
        "metrics": out.metrics,
        "per_group": out.per_group,
        "grads": grads,
        "weights": backend.weights(),
        "grad_norm": grad_norm,
    }


def _spawned(rank: int, world: int, init_file: str, out_dir: str, job, args: tuple) -> None:
    """The multi-process harness: one gloo process group, `job(rank, *args)` on this rank, its result
    saved as `<out_dir>/rank<r>.pt` (asserted in the test's own process)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file:// rendezvous in the test's own tmp dir: concurrent runs cannot meet each other (a free
    # TCP port can be taken by another run between probing and binding); a timeout turns a stuck
    # collective into an error instead of a hang.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    try:
        torch.save(job(rank, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn(tmp_path: Path, job, *args: object, world: int = 2) -> list[dict]:
    """`job(rank, *args)` in `world` gloo processes; every rank's result (rendezvous and results in
    `tmp_path`)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    mp.spawn(
        _spawned,
        args=(world, str(tmp_path / "rendezvous"), str(tmp_path), job, args),
        nprocs=world,
        join=True,
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
