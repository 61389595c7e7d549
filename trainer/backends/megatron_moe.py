"""A mixture of experts' load-balancing loss in the `megatron` backend, as transformers computes it.

transformers' Qwen3-MoE (`load_balancing_loss_func`, added when the config sets `output_router_logits`)
takes every layer's router logits of a forward together: with L layers, T tokens, E experts and top-k,
C_e the number of (layer, token, slot) routed to expert e and S_e the sum over layers and tokens of
expert e's softmax probability,

    aux = E * sum_e (C_e / (L T)) * (S_e / (L T))

and the trainer adds `router_aux_loss_coef x aux x n` to each micro-batch's policy-loss sum (n: its
valid tokens; docs/objective.md "Mixture of experts"). megatron-core's own load-balancing loss is
another one: per layer (a sum of L Switch losses, each with f_e over that layer's tokens, divided by
top-k), and under `calculate_per_token_loss` its gradient is divided by the batch's token count
with the policy loss's. So the backend turns megatron's off and adds transformers' here.

C_e does not depend on the weights, and only S_e carries a gradient: d(coef n aux)/dS_e =
coef n E C_e / (L T)^2. Each layer's S_e^l is attached to its router logits (`_ProbSumGradient`, as
megatron attaches its own aux loss with `MoEAuxLossAutoScaler`); its backward gives S_e^l that
gradient, read when the micro-batch's backward runs, by which time the whole forward (every layer's
C) is known. Activation recompute re-runs a layer's forward inside the backward: it re-attaches to
the same micro-batch's gradient, which is already set. Under sequence parallelism each TP rank routes
its slice of the packed row: C and T are summed over the TP group (no gradient), each rank's S^l
gets the gradient of its own tokens, and the router weight's gradient is summed over the TP ranks by
`finalize_model_grads` (megatron marks it `sequence_parallel`). Padding tokens (a packed row's
tail under sequence parallelism, an empty micro-batch) are routed but counted in neither C nor S
nor T, as transformers' pack has no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class _ProbSumGradient(torch.autograd.Function):
    """Identity on the router logits; in backward, gives the layer's probability sums S^l [E] the
    gradient of the micro-batch's load-balancing term (`RouterAuxLoss.gradient`)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, prob_sums: torch.Tensor, aux: RouterAuxLoss) -> torch.Tensor:
        ctx.aux = aux
        return logits

    @staticmethod
    def backward(ctx: Any, grad_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        gradient = ctx.aux.gradient
        if gradient is None:
            raise RuntimeError(
                "router aux loss: backward before the micro-batch's load-balancing gradient was set"
            )
        return grad_logits, gradient, None


@dataclass
class RouterAuxLoss:
    """transformers' load-balancing loss of one micro-batch at a time (see the module docstring)."""

    coef: float
    num_experts: int
    topk: int
    num_layers: int
    tp_group: Any = None  # the tensor-parallel group (counts are summed over it), None without TP
    real: torch.Tensor | None = (
        None  # [local tokens] bool: this rank's tokens of the row that are not padding
    )
    counts: torch.Tensor | None = None  # [E] C of this rank's tokens, all layers so far
    prob_sums: list[torch.Tensor] = field(
        default_factory=list
    )  # S^l of this rank's tokens (detached), per layer
    gradient: torch.Tensor | None = None  # [E] d(coef n aux)/dS, set by `finish`

    def start(self, real: torch.Tensor) -> None:
        """A micro-batch's forward begins; `real` marks this rank's tokens that are not padding."""
        self.real = real
        self.counts = torch.zeros(self.num_experts, dtype=torch.float32, device=real.device)
        self.prob_sums = []
        self.gradient = None

    def observe(self, logits: torch.Tensor) -> torch.Tensor:
        """A router's logits [s, b, E] (this rank's tokens): counted, and returned with S^l attached.
        Outside a training step (a forward-only call) the logits pass unchanged."""
        if self.real is None or self.counts is None:
            return logits
        flat = logits.reshape(-1, self.num_experts)
        real = self.real.to(torch.float32)[:, None]
        probs = torch.softmax(flat.float(), dim=-1)
        if self.gradient is None:  # the first forward; a recompute in backward leaves the counts as they are
            chosen = torch.topk(probs.detach(), self.topk, dim=-1).indices
            self.counts += torch.zeros_like(self.counts).scatter_add_(
                0, chosen.reshape(-1), real.expand(-1, self.topk).reshape(-1)
            )
            self.prob_sums.append((probs.detach() * real).sum(dim=0))
        prob_sums = (probs * real).sum(dim=0)
        return _ProbSumGradient.apply(logits, prob_sums, self)

    def stop(self) -> None:
        """The step is over: later forwards are forward-only."""
        self.real = self.counts = self.gradient = None
        self.prob_sums = []

    def finish(self, num_valid_tokens: int) -> float:
        """The micro-batch's forward is done: set the gradient of `coef x n x aux` for its backward and
        return aux (the value transformers reports)."""
        assert self.real is not None and self.counts is not None, "finish() before start()"
        totals = torch.stack(
            [
                self.counts,
                sum(self.prob_sums, torch.zeros_like(self.counts)),
                self.real.sum().to(torch.float32).expand(self.num_experts),
            ]
        )
        if self.tp_group is not None and torch.distributed.get_world_size(self.tp_group) > 1:
            torch.distributed.all_reduce(totals, group=self.tp_group)
        counts, prob_sums, tokens = totals[0], totals[1], float(totals[2, 0])
        rows = self.num_layers * tokens
        if rows == 0:  # an empty micro-batch: nothing routed that counts
            self.gradient = torch.zeros_like(counts)
            return 0.0
        self.gradient = self.coef * num_valid_tokens * self.num_experts * counts / rows**2
        return float(self.num_experts * (counts / rows * prob_sums / rows).sum())


@dataclass
class RouterLogits:
    """Each MoE layer's router logits of one micro-batch's first forward (detached; this rank's tokens),
    for the routing mismatch against the samplers' experts (backend_common `add_routing_metrics`)."""

    active: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)

    def start(self, active: bool) -> None:
        self.active, self.logits = active, []

    def observe(self, logits: torch.Tensor) -> torch.Tensor:
        if self.active:
            self.logits.append(logits.detach().reshape(-1, logits.shape[-1]))
        return logits

    def take(self) -> list[torch.Tensor]:
        """The layers' logits, in layer order; later forwards (activation recompute) add none."""
        taken, self.active, self.logits = self.logits, False, []
        return taken


def attach(routers: list[Any], observers: list[RouterAuxLoss | RouterLogits]) -> None:
    """Route every MoE layer's router logits (megatron's TopKRouter.gating output) through `observers`."""
    for router in routers:
        gating = router.gating

        def observed(input: torch.Tensor, gating: Any = gating) -> torch.Tensor:
            logits = gating(input)
            for observer in observers:
                logits = observer.observe(logits)
            return logits

        router.gating = observed
