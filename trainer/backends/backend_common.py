"""What both trainer backends (trainer/backends/backend_hf.py, trainer/backends/backend_megatron.py) share: the optimizer
configuration, the conversion of a FlatBatch into the objective's TokenBatch, and `RankCommands`, the
way rank 0 drives the other ranks of a multi-process trainer.

The trainer keeps fp32 master weights; what it PUBLISHES is the BF16 (or quantized) view, so every
sampler group, even a bf16 one, sees weights rounded away from the trainer's, plus its own kernels:
exactly the mismatch the objective corrects (docs/objective.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfleet.records import SUPPORT_MODE
from rlfleet.trainer.backends.routing import (
    ROUTING_COUNT,
    combine_routing_metrics,
    routing_metrics,
    routing_mismatch,
)
from rlfleet.trainer.objective import MEAN_METRICS, LossOutput, TokenBatch
from rlfleet.trainer.rollout.batching import FlatBatch

_log = logging.getLogger(__name__)

SUM_KEYS = ("num_tokens", "invalid_tokens")
MAX_KEYS = ("sc_tail_ratio_max",)


@dataclass
class OptimConfig:
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.99)

    def adamw(self, params: Any) -> torch.optim.AdamW:
        """The one optimizer the transformers backend trains with. Fused (one kernel per parameter group,
        CPU and GPU): the unfused step makes a temporary the size of each parameter (the [V, H]
        embedding's is as large as a 4K-token micro-batch's activations, docs/benchmarks.md)."""
        return torch.optim.AdamW(
            params, lr=self.learning_rate, weight_decay=self.weight_decay, betas=self.betas, fused=True
        )


def to_token_batch(flat: FlatBatch, group_index: dict[str, int]) -> TokenBatch:
    """FlatBatch (numpy, CSR candidates) -> the objective's TokenBatch (torch, padded [T, K])."""
    t = flat.num_tokens
    counts = np.diff(flat.cand_offsets)
    k = int(counts.max()) if t else 0
    cand_ids = np.full((t, k), -1, dtype=np.int64)
    cand_lq = np.full((t, k), -np.inf, dtype=np.float32)
    if t and k:
        rows = np.repeat(np.arange(t), counts)
        cols = np.arange(len(flat.cand_ids)) - np.repeat(flat.cand_offsets[:-1], counts)
        cand_ids[rows, cols] = flat.cand_ids
        cand_lq[rows, cols] = flat.cand_logq
    support = flat.candidate_mode == SUPPORT_MODE
    # In support mode the objective compares with q renormalised inside the support; in head mode with
    # the full-vocabulary q.
    logq = flat.logq_support if support else flat.logq
    return TokenBatch(
        tokens=torch.from_numpy(flat.target_ids),
        advantages=torch.from_numpy(flat.advantages),
        loss_mask=torch.ones(t, dtype=torch.bool),
        sampler_logprobs=torch.from_numpy(np.ascontiguousarray(logq, dtype=np.float32)),
        candidate_ids=torch.from_numpy(cand_ids),
        candidate_logprobs=torch.from_numpy(cand_lq),
        candidates_are_support=support,
        group_ids=torch.tensor([group_index.get(g, len(group_index)) for g in flat.groups], dtype=torch.long),
        staleness=torch.from_numpy(flat.staleness),
    )


def combine_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Metric dicts of one scope over disjoint token sets (micro-batches, ranks) -> the union's: counts
    add, token means are token-weighted, maxima take the max, a mixture of experts' routing mismatch is
    weighted by its compared tokens (trainer/backends/routing.py); all exact. One part is returned as is; with
    several the non-decomposable `ess` is dropped."""
    if len(parts) == 1:
        return dict(parts[0])
    out: dict[str, float] = {k: sum(p.get(k, 0.0) for p in parts) for k in SUM_KEYS}
    n = out["num_tokens"]
    for k in MEAN_METRICS:
        have = [p for p in parts if k in p]
        if have and n:
            out[k] = sum(p[k] * p["num_tokens"] for p in have) / n
    for k in MAX_KEYS:
        vals = [p[k] for p in parts if k in p]
        if vals:
            out[k] = max(vals)
    if any(ROUTING_COUNT in p for p in parts):
        out.update(combine_routing_metrics(parts))
    return out


def merge_loss_outputs(outs: list[LossOutput]) -> LossOutput:
    """The objective's outputs over disjoint token sets (micro-batches, ranks) -> the union's: the token
    mean loss (sum of sums / sum of counts, a detached value), metrics per scope by `combine_metrics`."""
    per_group: dict[int, list[dict[str, float]]] = {}
    per_stale: dict[str, list[dict[str, float]]] = {}
    for o in outs:
        for g, m in o.per_group.items():
            per_group.setdefault(g, []).append(m)
        for b, m in o.per_staleness.items():
            per_stale.setdefault(b, []).append(m)
    loss_sum = sum(float(o.loss_sum.detach()) if o.loss_sum is not None else 0.0 for o in outs)
    n_valid = sum(o.num_valid_tokens for o in outs)
    return LossOutput(
        loss=torch.tensor(loss_sum / max(n_valid, 1)),
        metrics=combine_metrics([o.metrics for o in outs]) if outs else {k: 0.0 for k in SUM_KEYS},
        per_group={g: combine_metrics(ms) for g, ms in sorted(per_group.items())},
        per_staleness={b: combine_metrics(ms) for b, ms in sorted(per_stale.items())},
        loss_sum=torch.tensor(loss_sum),
        num_valid_tokens=n_valid,
    )


class RankCommands:
    """Rank 0 drives, every other rank follows (the trainer entrypoint, trainer/entrypoint.py): rank 0
    runs the loop and calls `train_step` / `weights` / `state_dict` / `load_state_dict` / `close`; each
    of those first broadcasts a command (`broadcast_object_list` from global rank 0: "step" with the
    FlatBatch and group index, "weights", "state", "load", "stop"), and every other rank's `follow()`
    executes the same collective body with the same inputs until "stop". A backend defines the bodies
    `_train_step(flat, group_index)`, `_weights()`, `_state_dict()`, `_load_state_dict(part)` (`part`:
    what rank 0 passes; None on the followers) and `device`; `_has_followers()` says whether there are
    other ranks to command (a one-process backend sends nothing)."""

    device: torch.device

    def _train_step(self, flat: FlatBatch, group_index: dict[str, int]) -> Any: ...
    def _weights(self) -> Any: ...
    def _state_dict(self) -> Any: ...
    def _load_state_dict(self, part: Any) -> None: ...

    def _has_followers(self) -> bool:
        return True

    def _command(self, command: tuple | None = None) -> tuple:
        """Rank 0: send `command`; every other rank: receive rank 0's."""
        box: list[Any] = [command]  # rank 0's command, received by every other rank
        torch.distributed.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def _send(self, command: tuple) -> None:
        if self._has_followers():
            self._command(command)

    def _object_device(self) -> torch.device | None:
        # NCCL moves the pickled command through a GPU tensor; gloo through a CPU one.
        return torch.device("cuda", torch.cuda.current_device()) if self.device.type == "cuda" else None

    def follow(self) -> None:
        """Non-zero ranks: execute rank 0's commands until it says stop."""
        while True:
            command = self._command()
            if command[0] == "step":
                self._train_step(command[1], command[2])
            elif command[0] == "weights":
                self._weights()
            elif command[0] == "state":
                self._state_dict()
            elif command[0] == "load":
                self._load_state_dict(None)
            else:
                _store().set(_stopped_key(torch.distributed.get_rank()), "1")  # I have the stop
                _await_keys([RELEASED_KEY], "rank 0 to release this rank")
                return

    def close(self) -> None:
        """Rank 0: release the followers (their `follow()` returns) once each has confirmed the stop."""
        if self._has_followers() and torch.distributed.get_rank() == 0:
            self._command(("stop",))
            _await_keys(
                [_stopped_key(r) for r in range(1, torch.distributed.get_world_size())],
                "every follower rank to confirm the stop",
            )
            _store().set(RELEASED_KEY, "1")


# The end of a multi-rank trainer is a handshake through the rendezvous store, which torchrun's agent
# serves and which outlives every rank: each follower confirms the stop, and only then does rank 0 release
# them all. No rank ends while another is inside a gloo call with it: with the trainer image's torch (2.6,
# gloo), 2-rank torchrun runs of "broadcast the stop, leave the group, exit" hung in 6 of 23 (the stop
# lost as rank 0 ended at once, or rank 0 stuck in its broadcast as the follower ended), so the finished
# trainer's pod stayed Running and its RLJob never read Succeeded (issue 39). With the handshake: 0 of 13.
# After it no rank destroys its process group: in the trainer image, gloo's destroy hung holding the GIL
# on a rank whose peer had already ended (1 of 12 finishes), so no timeout could end it. Every rank ends
# with trainer/entrypoint.py `exit_now` (os._exit), which runs no destructor: gloo's threads are never
# torn down, and the interpreter's shutdown that once aborted a finished rank (SIGABRT) never runs.
STOP_HANDSHAKE_TIMEOUT_S = 60.0
RELEASED_KEY = "rlfleet/released"


def _stopped_key(rank: int) -> str:
    return f"rlfleet/stopped/{rank}"


def _store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def _await_keys(keys: list[str], what: str, timeout_s: float = STOP_HANDSHAKE_TIMEOUT_S) -> None:
    from datetime import timedelta

    try:
        _store().wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError on a timeout: the rank ends anyway, saying so
        _log.warning("waited %.0f s for %s in vain (%s); ending anyway", timeout_s, what, exc)


def routing_compared_rows(flat: FlatBatch, rows: np.ndarray) -> np.ndarray | None:
    """Which of `rows` get their sampler routing compared with the trainer's (bool [R]: routing returned,
    sampled at the trainer's version); None when the batch carries no routing."""
    if flat.routed_experts is None:
        return None
    routed = flat.routed_experts[rows]
    return (routed >= 0).all(axis=(1, 2)) & (flat.versions[rows] == flat.trainer_version)


def trainer_experts(router_logits: list[torch.Tensor], positions: torch.Tensor, k: int) -> np.ndarray:
    """The trainer's own routing at `positions` of a packed row: the top-k of the float32 softmax of
    each layer's router logits ([T, E] per layer) -> [R, layers, k]."""
    with torch.no_grad():
        per_layer = [
            torch.softmax(logits.float(), dim=-1)[positions].topk(k, dim=-1).indices
            for logits in router_logits
        ]
    return torch.stack(per_layer, dim=1).cpu().numpy()


def add_routing_metrics(
    out: LossOutput,
    flat: FlatBatch,
    full: TokenBatch,
    rows: np.ndarray,
    trainer: np.ndarray,
    compared: np.ndarray,
) -> None:
    """The routing mismatch (trainer/backends/routing.py) of a micro-batch's compared `rows` into `out`'s metrics
    and per-group metrics; `trainer`: the trainer's experts of each row [R, layers, k]."""
    sampler = flat.routed_experts
    assert sampler is not None  # routing_compared_rows said so
    token_differs, layer_share = routing_mismatch(trainer, sampler[rows])
    out.metrics.update(routing_metrics(token_differs, layer_share, compared))
    if full.group_ids is None:
        return
    group_ids = full.group_ids[torch.from_numpy(rows)].numpy()
    for gid in np.unique(group_ids).tolist():
        scoped = routing_metrics(token_differs, layer_share, compared & (group_ids == gid))
        if scoped:
            out.per_group.setdefault(int(gid), {}).update(scoped)
