"""The fleet-mix optimizer in the operator (`spec.router.optimize`). PURE: no I/O, no clock, no Kubernetes.

Per rebalance interval the rebalancer (rebalancer.py) reads each SamplerGroup (`fleet_reading`), keeps
each group's tokens/s per replica (`observe`), maps the readings and the RLJob's block to the request of
`rlfleet fleet plan` (`fleet_request`), and `decide`s: replicas per group (written through each
SamplerGroup's scale subresource) and the shares pushed to the routers instead of the share policy's.
docs/economics.md has the formulation ("The optimizer") and what the status shows ("In the operator").

- Tokens/s per replica = the group's decode tokens/s read this interval (before the share policy's EMA,
  which would mix replica counts) / its ready replicas, taken only while the group is steady: ready
  replicas = spec replicas, unchanged for the intervals the reading spans (one for scraped counters,
  the Prometheus rate window over the interval for `prometheusUrl`), or first seen since the operator
  started; a rate read while pods start or stop is of another replica count. Else the last steady
  figure is kept.
- A group without a figure (never steady with a reading, e.g. just created or at 0 replicas since the
  operator started), quarantined, or settling after a precision change (autopilot.py) is LEFT OUT: it keeps its replicas and the share policy's share; the
  groups in the plan must make the whole demand.
- A group `optimize.groups` does not name is in the plan with its replicas fixed (minReplicas =
  maxReplicas = its replicas): it counts toward the demand and the budgets, the optimizer never scales it.
- KL / out-of-range share the trainer has not reported count as 0.
- `PlanInfeasible` with a step bound: when a plan exists without it (the demand is out of reach within
  `maxStepReplicas` of the current replicas), the groups below that unstepped optimum go up one step
  and none goes down (`Stepping`); otherwise nothing changes (`Infeasible`) and the status says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlfleet.api.rljob import FleetOptimizeSpec
from rlfleet.catalog import Catalog, CatalogError
from rlfleet.fleet import (
    Budgets,
    Demand,
    FleetPlan,
    FleetPlanRequest,
    GroupFigures,
    PlanInfeasible,
    Reference,
    plan_fleet,
)

Decision = Literal["Scaled", "Kept", "Stepping", "Infeasible", "Waiting"]
REASON_LIMIT = 2048  # status.fleetPlan.reason's maxLength


@dataclass(frozen=True)
class FleetReading:
    """One SamplerGroup at one interval, as the optimizer reads it."""

    name: str
    accelerator: str
    weight_format: str
    gpus_per_replica: int
    cost_per_replica_hour: float  # USD: the catalog's price per GPU-hour x gpus_per_replica
    replicas: int  # spec.replicas: what the plan changes
    ready_replicas: int
    tokens_per_second: float | None  # the group's decode tokens/s read this interval (not smoothed)
    kl: float | None  # the trainer's kl_k3 of its tokens
    oor_fraction: float | None
    quarantined: bool
    spot: bool = False  # spec.spot: the optimizer's tie-break removes its replicas first


@dataclass(frozen=True)
class ReferenceFigures:
    """The reference fleet as the interval's economics measured it (None: unknown)."""

    accelerator: str
    tokens_per_gpu_second: float | None
    cost_per_gpu_hour: float | None
    oor_fraction: float | None


@dataclass
class FleetMemory:
    """Per group: the last steady tokens/s per replica; the ready replicas of the last interval and for
    how many intervals they have not changed."""

    per_replica: dict[str, float] = field(default_factory=dict)
    ready: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetDecision:
    decision: Decision
    reason: str
    replicas: dict[str, int]  # every group after this decision
    current: dict[str, int]  # every group before it
    shares: dict[str, float] | None = None  # None: the share policy's shares stand
    plan: FleetPlan | None = None

    def changes(self) -> dict[str, tuple[int, int]]:
        """Group -> (from, to) replicas, for the groups this decision scales."""
        return {g: (self.current[g], x) for g, x in self.replicas.items() if self.current.get(g) != x}

    def status(self) -> dict[str, Any]:
        """RLJob `status.fleetPlan` (camelCase, None dropped)."""
        out: dict[str, Any] = {
            "decision": self.decision,
            "reason": _clip(self.reason),
            "replicas": dict(self.replicas),
            "binding": [b.message[:512] for b in self.plan.binding] if self.plan else [],
        }
        if self.plan is not None:
            out["costPerHour"] = round(self.plan.cost_per_hour, 4)
            if self.plan.cost_per_1m_usable_tokens is not None:
                out["costPer1MUsableTokens"] = round(self.plan.cost_per_1m_usable_tokens, 4)
        return out


def _clip(text: str) -> str:
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def fleet_reading(
    sg: Mapping[str, Any], price_per_gpu_hour: float, default_tensor_parallel: int, tokens_per_second: float | None,
    kl: float | None, oor_fraction: float | None, quarantined: bool,
) -> FleetReading:  # fmt: skip
    """A SamplerGroup object (spec, status) with the interval's figures."""
    spec, status = sg.get("spec") or {}, sg.get("status") or {}
    tp = int(spec.get("tensorParallel") or default_tensor_parallel)
    return FleetReading(
        name=spec.get("name", ""),
        accelerator=spec.get("accelerator", ""),
        weight_format=spec.get("weightFormat", "bf16"),
        gpus_per_replica=tp,
        cost_per_replica_hour=price_per_gpu_hour * tp,
        replicas=int(spec.get("replicas", 1)),
        ready_replicas=int(status.get("readyReplicas") or 0),
        tokens_per_second=tokens_per_second,
        kl=kl,
        oor_fraction=oor_fraction,
        quarantined=quarantined,
        spot=bool(spec.get("spot", False)),
    )


def observe(memory: FleetMemory, readings: Sequence[FleetReading], settle_intervals: int = 1) -> FleetMemory:
    """The memory after this interval: a group's tokens/s per replica is taken when it is steady (ready =
    replicas > 0, and ready unchanged for `settle_intervals` intervals, or first seen) and made tokens;
    else the last steady figure stays. Groups gone are dropped."""
    out = FleetMemory()
    for r in readings:
        previous = memory.ready.get(r.name)
        unchanged = previous[1] + 1 if previous is not None and previous[0] == r.ready_replicas else 0
        settled = previous is None or unchanged >= settle_intervals
        if r.ready_replicas == r.replicas > 0 and settled and r.tokens_per_second is not None and r.tokens_per_second > 0:
            out.per_replica[r.name] = r.tokens_per_second / r.ready_replicas
        elif r.name in memory.per_replica:
            out.per_replica[r.name] = memory.per_replica[r.name]
        out.ready[r.name] = (r.ready_replicas, unchanged)
    return out


def trainer_demand(trainer: Mapping[str, float], headroom: float) -> float | None:
    """Usable tokens/s the trainer consumes, from its last step's fleet metrics (the exporter's
    `rlfleet_trainer_*{scope="fleet"}`): the tokens it sampled per step (`episodes` x `response_length`,
    the mean of the model-generated tokens per episode) over its training seconds per step
    (`time_train`), so the rate at which a trainer that never waits on rollouts takes them, times the
    in-band share (1 - `oor_fraction`: the plan's demand counts usable tokens) and `headroom`. None
    before the trainer has reported a step."""
    episodes, length, seconds = trainer.get("episodes"), trainer.get("response_length"), trainer.get("time_train")
    if episodes is None or length is None or seconds is None or seconds <= 0 or episodes * length <= 0:
        return None
    usable = 1.0 - min(max(trainer.get("oor_fraction", 0.0), 0.0), 1.0)
    return episodes * length / seconds * usable * headroom


def demand_of(spec: FleetOptimizeSpec, trainer: Mapping[str, float]) -> tuple[float | None, str]:
    """This interval's demand (None: not known yet) and where it came from, for the status."""
    if spec.demand is None:
        return None, "no demand"
    if spec.demand.usable_tokens_per_second is not None:
        return spec.demand.usable_tokens_per_second, "given"
    derived = trainer_demand(trainer, spec.demand.headroom)
    if derived is None:
        return None, "derived from the trainer's steps, none reported yet"
    return derived, (f"derived: {trainer['episodes'] * trainer['response_length']:.0f} tokens per step over "
                     f"{trainer['time_train']:.2f} s of training, x {1.0 - min(max(trainer.get('oor_fraction', 0.0), 0.0), 1.0):.3f} "
                     f"in band x headroom {spec.demand.headroom:g}")  # fmt: skip


def fleet_request(
    spec: FleetOptimizeSpec, trainer_accelerator: str, reference: ReferenceFigures,
    readings: Sequence[FleetReading], per_replica: Mapping[str, float], held: Mapping[str, str] | None = None,
    trainer: Mapping[str, float] | None = None,
) -> tuple[FleetPlanRequest | None, dict[str, str]]:  # fmt: skip
    """The request of `plan_fleet` for this interval, and the groups left out of it with why (None: no
    group is in it, or the demand is not known yet). `held`: groups another controller is changing (the
    precision autopilot), left out with its reason. `trainer`: the trainer's last fleet metrics, for a
    derived demand (`demand_of`). Module docstring: the rules."""
    left_out: dict[str, str] = {}
    figures: list[GroupFigures] = []
    for r in readings:
        if r.name in (held or {}):
            left_out[r.name] = (held or {})[r.name]
            continue
        if r.quarantined:
            left_out[r.name] = "quarantined"
            continue
        if r.name not in per_replica:
            left_out[r.name] = "no throughput reading yet"
            continue
        bounds = spec.groups.get(r.name)
        figures.append(GroupFigures(
            name=r.name,
            accelerator=r.accelerator,
            weight_format=r.weight_format,
            gpus_per_replica=r.gpus_per_replica,
            cost_per_replica_hour=r.cost_per_replica_hour,
            tokens_per_second_per_replica=per_replica[r.name],
            kl=r.kl or 0.0,
            oor_fraction=min(max(r.oor_fraction or 0.0, 0.0), 1.0),
            min_replicas=bounds.min_replicas if bounds else r.replicas,
            max_replicas=bounds.max_replicas if bounds else r.replicas,
            replicas=r.replicas,
            max_kl=bounds.max_kl if bounds else None,
            max_oor_fraction=bounds.max_oor_fraction if bounds else None,
            spot=r.spot,
        ))  # fmt: skip
    demand, _ = demand_of(spec, trainer or {})
    if not figures or demand is None:
        return None, left_out
    budgets = spec.budgets
    request = FleetPlanRequest(
        trainer_accelerator=trainer_accelerator,
        demand=Demand(usable_tokens_per_second=demand),
        budgets=Budgets(max_kl=budgets.max_kl, max_oor_fraction=budgets.max_oor_fraction,
                        group_max_kl=budgets.group_max_kl, group_max_oor_fraction=budgets.group_max_oor_fraction),
        max_step_replicas=spec.max_step_replicas,
        hysteresis=spec.hysteresis,
        groups=figures,
        reference=Reference(
            accelerator=reference.accelerator,
            gpus_per_replica=1,
            cost_per_replica_hour=reference.cost_per_gpu_hour,
            tokens_per_second_per_replica=reference.tokens_per_gpu_second,
            oor_fraction=reference.oor_fraction if reference.oor_fraction is None or reference.oor_fraction < 1 else None,
        ),
    )  # fmt: skip
    return request, left_out


def merged_shares(
    plan_shares: Mapping[str, float], left_out: Mapping[str, str], policy_shares: Mapping[str, float]
) -> dict[str, float]:
    """The shares to push: each group left out keeps the share policy's share; the planned groups split
    the rest in the plan's proportions."""
    kept = {g: policy_shares.get(g, 0.0) for g in left_out}
    rest = max(1.0 - sum(kept.values()), 0.0)
    return {**{g: s * rest for g, s in plan_shares.items()}, **kept}


def decide(
    request: FleetPlanRequest | None, left_out: Mapping[str, str], readings: Sequence[FleetReading],
    policy_shares: Mapping[str, float], catalog: Catalog | None = None, demand_source: str = "given",
) -> FleetDecision:  # fmt: skip
    """One interval's decision (module docstring). `demand_source`: `demand_of`'s account of the demand."""
    current = {r.name: r.replicas for r in readings}
    out = "; ".join(f"{g} keeps its replicas ({why})" for g, why in left_out.items())

    def unchanged(decision: Decision, reason: str) -> FleetDecision:
        return FleetDecision(decision, "; ".join(p for p in (reason, out) if p), dict(current), current)

    if request is None:
        waiting = ("no group has a throughput reading yet" if len(left_out) == len(readings)
                   else f"the demand is not known yet ({demand_source})")  # fmt: skip
        return unchanged("Waiting", f"{waiting}: replicas kept, shares by the share policy")
    if demand_source != "given":
        out = "; ".join(p for p in (f"demand {request.demand.usable_tokens_per_second:.0f} usable tokens/s {demand_source}", out) if p)
    try:
        plan = plan_fleet(request, catalog)
    except PlanInfeasible as exc:
        return _step_toward_unstepped_optimum(request, exc, current, out, catalog) or unchanged(
            "Infeasible", f"{exc}: replicas kept, shares by the share policy"
        )
    except CatalogError as exc:
        return unchanged("Waiting", f"no plan: {exc}")
    replicas = {**current, **plan.replicas()}
    changed = any(replicas[g] != current[g] for g in current)
    reason = f"{plan.reason}; plan ${plan.cost_per_hour:.2f}/h"
    if plan.cost_per_1m_usable_tokens is not None:
        reason += f", ${plan.cost_per_1m_usable_tokens:.4f} per 1M usable tokens"
    return FleetDecision(
        decision="Scaled" if changed else "Kept",
        reason="; ".join(p for p in (reason, out) if p),
        replicas=replicas,
        current=current,
        shares=merged_shares({g.name: g.share for g in plan.groups}, left_out, policy_shares),
        plan=plan,
    )


def _step_toward_unstepped_optimum(
    request: FleetPlanRequest, infeasible: PlanInfeasible, current: Mapping[str, int], out: str,
    catalog: Catalog | None,
) -> FleetDecision | None:  # fmt: skip
    """`Stepping` when the step bound alone makes the request infeasible (module docstring), else None."""
    step = request.max_step_replicas
    if step is None:
        return None
    try:
        target = plan_fleet(request.model_copy(update={"max_step_replicas": None}), catalog, explain=False).replicas()
    except (PlanInfeasible, CatalogError):
        return None
    replicas = {g: (min(target[g], x + step) if target.get(g, x) > x else x) for g, x in current.items()}
    if replicas == dict(current):
        return None
    reason = (f"no plan within {step} replica(s) per group of the current ones meets the constraints ({infeasible}); "
              f"the optimum without the step bound is {target}: the groups below it go up by at most {step}, "
              "none goes down; shares by the share policy")  # fmt: skip
    return FleetDecision("Stepping", "; ".join(p for p in (reason, out) if p), replicas, dict(current))
