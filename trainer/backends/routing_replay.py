"""Rollout routing replay (R3, RLJob `correction.routingReplay`): the trainer's mixture-of-experts layers
route each token whose sampler returned routing to the SAMPLER's top-k experts, not to the top-k of the
trainer's own router (docs/objective.md, "Routing replay").

Per replayed token and MoE layer, with the trainer's router logits z (its own weights, its own input):
the experts are the sampler's ids E (the top-k the sampler's router picked), and the gate weights are the
trainer's router softmax over those ids, w_e = softmax(z)_e for e in E, divided by their sum when the
config sets `norm_topk_prob` (Qwen3-MoE does), exactly as transformers weights its own top-k. So the
router still gets gradients, through the gate weights of the replayed experts; only the (discontinuous,
gradient-free) choice of the experts is the sampler's. Tokens without routing (rows of -1) route as
usual. The router logits the model records (`output_router_logits`: the load-balancing loss and the
routing-mismatch metric, trainer/backends/routing.py) stay the trainer's own.

The hook: a forward hook on each transformers `Qwen3MoeTopKRouter` (the `gate` of a
`Qwen3MoeSparseMoeBlock`) replacing its output `(router_logits, top_k_weights, top_k_index)` on the
replayed rows; the block then hands those to its experts unchanged. This depends on transformers >= 5
(5.19.0 here), whose `Qwen3MoeSparseMoeBlock.forward` is `_, weights, selected = self.gate(hidden)` then
`self.experts(hidden, selected, weights)`, with the router taking the top-k of the float32 softmax and
renormalising when `norm_topk_prob`; transformers 4.x computed the top-k inline in the block's forward
(no router module to hook), and a release that changes the router's output tuple breaks this hook
(tests/trainer/test_trainer_routing_replay.py pins it against a hand-computed layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Qwen3-MoE routers in layer order (the order of its `router_logits` and of the
    sampler's routed-experts layers); [] for a model without one."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]


def check_replayable(model: torch.nn.Module) -> None:
    """Refuse routing replay for a model with no Qwen3-MoE router (a dense model, or another MoE family
    whose router this hook does not know)."""
    if not moe_routers(model):
        raise ValueError(
            f"correction.routingReplay: {type(model).__name__} has no Qwen3-MoE router (transformers' "
            "Qwen3MoeTopKRouter): routing replay needs a Qwen3-MoE model (a dense model has no routing to replay)"
        )


def _replayed_output(
    router: torch.nn.Module, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor], experts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's `(logits, weights, index)` with the rows of `experts` (int64 [N, top_k], -1 rows:
    not replayed) routed to those ids, weighted by the router's own softmax over them."""
    logits, weights, index = output
    if experts.shape != index.shape:
        raise ValueError(
            f"routing replay: {experts.shape[0]} positions x top-{experts.shape[-1]} replayed experts for a router "
            f"that routed {index.shape[0]} positions to its top-{index.shape[-1]}"
        )
    replayed = (experts >= 0).all(dim=-1)  # [N]
    ids = experts.clamp(min=0)
    # the same computation as transformers' router on its own top-k, on the sampler's ids instead
    chosen = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, ids)
    if router.norm_topk_prob:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    chosen = chosen.to(logits.dtype)
    keep = replayed[:, None]
    return logits, torch.where(keep, chosen, weights), torch.where(keep, ids, index)


@contextmanager
def replay_routing(model: torch.nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, every forward of `model` routes position p of MoE layer l to `experts[p, l]`
    (int [positions, layers, top_k] over the flattened batch x sequence positions of the forward; a
    position whose row holds a -1 routes as usual). Refused: a model with no Qwen3-MoE router, a layer
    count or expert id the model does not have."""
    check_replayable(model)
    routers = moe_routers(model)
    if experts.ndim != 3 or experts.shape[1] != len(routers):
        raise ValueError(
            f"routing replay: routed experts must be [positions, {len(routers)} MoE layers, top_k], got "
            f"{tuple(experts.shape)}"
        )
    num_experts = int(getattr(routers[0], "num_experts"))  # noqa: B009 (a tensor-or-module attribute to mypy)
    if int(experts.max()) >= num_experts:
        raise ValueError(
            f"routing replay: expert id {int(experts.max())} >= the model's {num_experts} experts"
        )
    experts = experts.long()

    def hook_for(layer: int) -> Any:
        def hook(router: torch.nn.Module, _args: Any, output: Any) -> tuple[torch.Tensor, ...]:
            return _replayed_output(router, output, experts[:, layer].to(output[2].device))

        return hook

    handles = [router.register_forward_hook(hook_for(layer)) for layer, router in enumerate(routers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["check_replayable", "moe_routers", "replay_routing"]
