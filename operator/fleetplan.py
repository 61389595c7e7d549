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
  figure is kept, unless the group's weightFormat changed since (a figure of another format is dropped).
  The figure is kept in the RLJob's `status.decisions` (decide.py) and read back from it after an
  operator restart: a group at 0 replicas is never steady, so without it a restart would leave such a
  group out until someone scaled it by hand.
- A group read with every queue empty (each pod's `sglang:num_queue_reqs` 0, rebalance.py `queues_empty`)
  made what it was sent, not what it can do: behind a light producer tokens/s per replica fall as
  replicas are added, so planning from them would scale an idle fleet UP every interval and never down.
  Such a reading replaces the kept figure only where it is higher: an idle fleet is planned from the
  figures of its saturated intervals (some request queued, or the queue unknown: no gauge, Prometheus),
  and scaled down to the demand. A group never read saturated at its weightFormat has only a LOWER
  BOUND: it is planned with its replicas fixed, counting toward the demand at that bound, until a reading
  with requests queued (`lowerBound` in status.fleetPlan.throughput, and in the reason).
- A group at 0 replicas with no figure (never steady: created at 0 replicas, or its format changed) is
  planned at an ESTIMATE when another group has a saturated figure (`plan_figures`): those groups' tokens/s per GPU
  carried to its class and format by the catalog's relative decode throughputs (as the reference
  fleet's estimate, rlfleet/fleet.py), marked `estimated` in status.fleetPlan.throughput and the reason.
- A group with neither (replicas not steady yet, no group measured yet, or no catalog ratio for its
  class and format), quarantined, or settling after a precision change (autopilot.py) is LEFT OUT: it
  keeps its replicas and the share policy's share; the groups in the plan must make the whole demand.
- A group with an egress price (`spec.egressPricePerGb`) pays for its weight traffic per replica-hour on
  top of its GPUs (`GroupFigures.egress_cost_per_replica_hour`): the rebalance's smoothed rate of its
  view's stored bytes x 3600 / 1e9 x the price (rebalance.py `replica_egress_cost_per_hour`, the figure
  the share policy charges per ready replica), so the plan's cost and its choice weigh it; until that rate
  is read it is planned without it, and the reason says so (`egress_notes`).
- A group `optimize.groups` does not name is in the plan with its replicas fixed (minReplicas =
  maxReplicas = its replicas): it counts toward the demand and the budgets, the optimizer never scales it.
- KL / out-of-range share the trainer has not reported count as 0.
- `PlanInfeasible` with a step bound: when a plan exists without it (the demand is out of reach within
  `maxStepReplicas` of the current replicas), the groups below that unstepped optimum go up one step
  and none goes down (`Stepping`); otherwise nothing changes (`Infeasible`) and the status says why.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rlfleet.api.router_spec import FleetOptimizeSpec
from rlfleet.catalog import Catalog, CatalogError
from rlfleet.fleet import (
    Budgets,
    Demand,
    FleetPlan,
    FleetPlanRequest,
    GroupFigures,
    MeasuredGroup,
    PlanInfeasible,
    Reference,
    estimated_reference_tokens_per_gpu_second,
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
    egress_price_per_gb: float | None = None  # spec.egressPricePerGb: it pays for the weights it reads
    # USD/h one replica pays for them (rebalance.py `replica_egress_cost_per_hour`); None: no price, or its
    # view's stored bytes not read yet (then planned without it)
    egress_cost_per_replica_hour: float | None = None
    # every pod read reports `sglang:num_queue_reqs` 0 (rebalance.py `queues_empty`): nothing waited, so its
    # tokens/s are what it was sent, a lower bound on what it can do (False: requests queued, or unknown)
    queues_empty: bool = False


@dataclass(frozen=True)
class ReferenceFigures:
    """The reference fleet as the interval's economics measured it (None: unknown)."""

    accelerator: str
    tokens_per_gpu_second: float | None
    cost_per_gpu_hour: float | None
    oor_fraction: float | None


@dataclass(frozen=True)
class SteadyFigure:
    """A group's last steady tokens/s per replica and what it was read at (kept in the RLJob's
    `status.decisions`, so that it survives an operator restart)."""

    tokens_per_second_per_replica: float
    replicas: int  # the ready replicas it was read over
    weight_format: str
    measured_at: str | None = None  # RFC 3339 (None: not known)
    # a reading at saturation (some request queued, or the queue unknown) of this weightFormat is behind
    # it; False: read only with every queue empty, a lower bound on its capacity (the plan keeps its replicas)
    saturated: bool = True


@dataclass(frozen=True)
class PlanFigure:
    """The tokens/s per replica a group is planned at, and from what."""

    tokens_per_second_per_replica: float
    # measured: a steady reading at saturation (or above one); lowerBound: read only with queues empty;
    # estimated: carried from the saturated groups by the catalog
    basis: Literal["measured", "lowerBound", "estimated"]
    detail: str  # the steady reading it is, or the measured groups the estimate comes from

    def status(self) -> dict[str, Any]:
        """One group of RLJob `status.fleetPlan.throughput`."""
        return {
            "tokensPerSecondPerReplica": round(self.tokens_per_second_per_replica, 1),
            "basis": self.basis,
            "detail": self.detail[:256],
        }


@dataclass
class FleetMemory:
    """Per group: the last steady figure; the ready replicas of the last interval and for how many
    intervals they have not changed."""

    steady: dict[str, SteadyFigure] = field(default_factory=dict)
    ready: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def per_replica(self) -> dict[str, float]:
        """Group -> its last steady tokens/s per replica."""
        return {g: f.tokens_per_second_per_replica for g, f in self.steady.items()}


@dataclass(frozen=True)
class FleetDecision:
    decision: Decision
    reason: str
    replicas: dict[str, int]  # every group after this decision
    current: dict[str, int]  # every group before it
    shares: dict[str, float] | None = None  # None: the share policy's shares stand
    plan: FleetPlan | None = None
    figures: dict[str, PlanFigure] = field(default_factory=dict)  # the planned groups' tokens/s per replica

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
        if self.figures:
            out["throughput"] = {g: f.status() for g, f in self.figures.items()}
        if self.plan is not None:
            out["costPerHour"] = round(self.plan.cost_per_hour, 4)
            if self.plan.cost_per_1m_usable_tokens is not None:
                out["costPer1MUsableTokens"] = round(self.plan.cost_per_1m_usable_tokens, 4)
        return out


def _clip(text: str) -> str:
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 3] + "..."


def fleet_reading(
    sg: Mapping[str, Any],
    price_per_gpu_hour: float,
    default_tensor_parallel: int,
    tokens_per_second: float | None,
    kl: float | None,
    oor_fraction: float | None,
    quarantined: bool,
    egress_cost_per_replica_hour: float | None = None,
    queues_empty: bool = False,
) -> FleetReading:
    """A SamplerGroup object (spec, status) with the interval's figures (`egress_cost_per_replica_hour`: its
    weight traffic per replica, from the rebalance's reading of its view; None: none read, or no price;
    `queues_empty`: rebalance.py `queues_empty` of its pods at this interval)."""
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
        egress_price_per_gb=spec.get("egressPricePerGb"),
        egress_cost_per_replica_hour=egress_cost_per_replica_hour,
        queues_empty=queues_empty,
    )


def observe(
    memory: FleetMemory, readings: Sequence[FleetReading], settle_intervals: int = 1, now: str | None = None
) -> FleetMemory:
    """The memory after this interval: a group's tokens/s per replica is taken when it is steady (ready =
    replicas > 0, and ready unchanged for `settle_intervals` intervals, or first seen) and made tokens
    (`now`: its measuredAt); else the last steady figure stays while it is of the group's weightFormat.
    A reading with every queue empty is what the group was sent, a lower bound on what it can do: it
    replaces the figure kept only where it is higher (an idle fleet keeps the figures of its saturated
    intervals, so that the plan can scale it down), and with no saturated reading behind it the figure is
    marked not `saturated`. Groups gone are dropped."""
    out = FleetMemory()
    for r in readings:
        previous = memory.ready.get(r.name)
        unchanged = previous[1] + 1 if previous is not None and previous[0] == r.ready_replicas else 0
        settled = previous is None or unchanged >= settle_intervals
        kept = memory.steady.get(r.name)
        if kept is not None and kept.weight_format != r.weight_format:
            kept = None
        if (
            r.ready_replicas == r.replicas > 0
            and settled
            and r.tokens_per_second is not None
            and r.tokens_per_second > 0
        ):
            read = SteadyFigure(
                r.tokens_per_second / r.ready_replicas, r.ready_replicas, r.weight_format, now
            )
            if not r.queues_empty:
                out.steady[r.name] = read
            elif kept is None:
                out.steady[r.name] = replace(read, saturated=False)
            elif read.tokens_per_second_per_replica > kept.tokens_per_second_per_replica:
                out.steady[r.name] = replace(read, saturated=kept.saturated)
            else:
                out.steady[r.name] = kept
        elif kept is not None:
            out.steady[r.name] = kept
        out.ready[r.name] = (r.ready_replicas, unchanged)
    return out


def plan_figures(
    readings: Sequence[FleetReading], memory: FleetMemory, catalog: Catalog
) -> dict[str, PlanFigure]:
    """The tokens/s per replica each group is planned at: its last steady figure (`measured`, or
    `lowerBound` when only readings with every queue empty are behind it), else, for a group at 0
    replicas, an estimate from the saturated groups through the catalog's relative decode throughputs
    (`estimated`; none without a saturated group or a ratio for the group's class and format). A group
    with replicas gets none until it is measured (its pods are about to be), and a quarantined group is
    left out of the plan anyway."""
    out: dict[str, PlanFigure] = {}
    measured: list[MeasuredGroup] = []
    for r in readings:
        figure = memory.steady.get(r.name)
        if figure is None:
            continue
        at = f", {figure.measured_at}" if figure.measured_at else ""
        read = f"steady reading over {figure.replicas} replica(s) at {figure.weight_format}{at}"
        if not figure.saturated:
            out[r.name] = PlanFigure(
                figure.tokens_per_second_per_replica, "lowerBound", f"{read}, its queues empty"
            )
            continue  # what it was sent, not its capacity: no ground for another group's estimate
        out[r.name] = PlanFigure(figure.tokens_per_second_per_replica, "measured", read)
        if catalog.decode_throughput(r.accelerator, r.weight_format) is not None:
            measured.append(
                MeasuredGroup(
                    r.name,
                    r.accelerator,
                    r.weight_format,
                    r.gpus_per_replica,
                    0.0,
                    figure.tokens_per_second_per_replica,
                    None,
                )
            )
    for r in readings:
        if r.name in out or r.quarantined or r.replicas > 0 or not measured:
            continue
        per_gpu = estimated_reference_tokens_per_gpu_second(measured, r.accelerator, catalog, r.weight_format)
        if per_gpu is None or per_gpu <= 0:
            continue
        out[r.name] = PlanFigure(
            per_gpu * r.gpus_per_replica,
            "estimated",
            f"estimated from catalog throughput ratios ({r.accelerator} {r.weight_format} "
            f"against the measured {', '.join(g.name for g in measured)})",
        )
    return out


def trainer_demand(trainer: Mapping[str, float], headroom: float) -> float | None:
    """Usable tokens/s the trainer consumes, from its last step's fleet metrics (the exporter's
    `rlfleet_trainer_*{scope="fleet"}`): the tokens it sampled per step (`episodes` x `response_length`,
    the mean of the model-generated tokens per episode) over its training seconds per step
    (`time_train`), so the rate at which a trainer that never waits on rollouts takes them, times the
    in-band share (1 - `oor_fraction`: the plan's demand counts usable tokens) and `headroom`. None
    before the trainer has reported a step."""
    episodes, length, seconds = (
        trainer.get("episodes"),
        trainer.get("response_length"),
        trainer.get("time_train"),
    )
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
    return derived, (
        f"derived: {trainer['episodes'] * trainer['response_length']:.0f} tokens per step over "
        f"{trainer['time_train']:.2f} s of training, x {1.0 - min(max(trainer.get('oor_fraction', 0.0), 0.0), 1.0):.3f} "
        f"in band x headroom {spec.demand.headroom:g}"
    )


def fleet_request(
    spec: FleetOptimizeSpec,
    trainer_accelerator: str,
    reference: ReferenceFigures,
    readings: Sequence[FleetReading],
    per_replica: Mapping[str, float],
    held: Mapping[str, str] | None = None,
    trainer: Mapping[str, float] | None = None,
    lower_bounds: Collection[str] = (),
) -> tuple[FleetPlanRequest | None, dict[str, str]]:
    """The request of `plan_fleet` for this interval, and the groups left out of it with why (None: no
    group is in it, or the demand is not known yet). `held`: groups another controller is changing (the
    precision autopilot), left out with its reason. `trainer`: the trainer's last fleet metrics, for a
    derived demand (`demand_of`). `lower_bounds`: the groups whose figure is a lower bound (`plan_figures`'
    `lowerBound`), planned with their replicas fixed. Module docstring: the rules."""
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
        # a group named in `lower_bounds` is planned at its replicas: more of them would be planned from
        # what it was sent, and the plan would scale an idle fleet up (its readings fall as it grows)
        bounds = None if r.name in lower_bounds else spec.groups.get(r.name)
        figures.append(
            GroupFigures(
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
                egress_cost_per_replica_hour=r.egress_cost_per_replica_hour,
            )
        )
    demand, _ = demand_of(spec, trainer or {})
    if not figures or demand is None:
        return None, left_out
    # the RLJob's budgets are the optimizer's, field by field (FleetBudgetsSpec's names are Budgets')
    request = FleetPlanRequest(
        trainer_accelerator=trainer_accelerator,
        demand=Demand(usable_tokens_per_second=demand),
        budgets=Budgets(**spec.budgets.model_dump()),
        max_step_replicas=spec.max_step_replicas,
        hysteresis=spec.hysteresis,
        groups=figures,
        reference=Reference(
            accelerator=reference.accelerator,
            gpus_per_replica=1,
            cost_per_replica_hour=reference.cost_per_gpu_hour,
            tokens_per_second_per_replica=reference.tokens_per_gpu_second,
            oor_fraction=reference.oor_fraction
            if reference.oor_fraction is None or reference.oor_fraction < 1
            else None,
        ),
    )
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
    request: FleetPlanRequest | None,
    left_out: Mapping[str, str],
    readings: Sequence[FleetReading],
    policy_shares: Mapping[str, float],
    catalog: Catalog | None = None,
    demand_source: str = "given",
    figures: Mapping[str, PlanFigure] | None = None,
) -> FleetDecision:
    """One interval's decision (module docstring). `demand_source`: `demand_of`'s account of the demand;
    `figures`: `plan_figures` (the planned ones go to the status; an estimate is named in the reason)."""
    current = {r.name: r.replicas for r in readings}
    planned = {g.name for g in request.groups} if request is not None else set()
    used = {g: f for g, f in (figures or {}).items() if g in planned}
    estimates = "; ".join(
        f"{g} planned at an estimated {f.tokens_per_second_per_replica:.0f} tokens/s per replica "
        f"(no steady reading of its own: {f.detail})"
        for g, f in used.items()
        if f.basis == "estimated"
    )
    lower = "; ".join(
        f"{g} keeps its {current[g]} replica(s), planned at {f.tokens_per_second_per_replica:.0f} tokens/s "
        "per replica: a lower bound (read only with its queues empty: it made what it was sent) until it is "
        "read with requests queued"
        for g, f in used.items()
        if f.basis == "lowerBound"
    )
    egress = egress_notes(readings, planned)
    out = "; ".join(
        p
        for p in (
            estimates,
            lower,
            egress,
            *(f"{g} keeps its replicas ({why})" for g, why in left_out.items()),
        )
        if p
    )

    def unchanged(decision: Decision, reason: str) -> FleetDecision:
        return FleetDecision(
            decision, "; ".join(p for p in (reason, out) if p), dict(current), current, figures=used
        )

    if request is None:
        waiting = (
            "no group has a throughput reading yet"
            if len(left_out) == len(readings)
            else f"the demand is not known yet ({demand_source})"
        )
        return unchanged("Waiting", f"{waiting}: replicas kept, shares by the share policy")
    if demand_source != "given":
        out = "; ".join(
            p
            for p in (
                f"demand {request.demand.usable_tokens_per_second:.0f} usable tokens/s {demand_source}",
                out,
            )
            if p
        )
    try:
        plan = plan_fleet(request, catalog)
    except PlanInfeasible as exc:
        return _step_toward_unstepped_optimum(request, exc, current, out, catalog, used) or unchanged(
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
        figures=used,
    )


def egress_notes(readings: Sequence[FleetReading], planned: set[str]) -> str:
    """For the reason: what each planned group with an egress price is charged per replica for its weight
    traffic, or that it is planned without it (its view's stored bytes not read yet). A group without a
    price pays none and is not named."""
    notes = []
    for r in readings:
        if r.name not in planned or not r.egress_price_per_gb:
            continue
        if r.egress_cost_per_replica_hour is None:
            notes.append(
                f"{r.name} planned without its weight traffic (egress ${r.egress_price_per_gb:g}/GB: its "
                f"{r.weight_format} view's stored bytes not read yet)"
            )
        else:
            notes.append(
                f"{r.name} pays ${r.egress_cost_per_replica_hour:.4f}/h per replica for its weight traffic "
                f"(egress ${r.egress_price_per_gb:g}/GB), in its cost"
            )
    return "; ".join(notes)


def _step_toward_unstepped_optimum(
    request: FleetPlanRequest,
    infeasible: PlanInfeasible,
    current: Mapping[str, int],
    out: str,
    catalog: Catalog | None,
    figures: Mapping[str, PlanFigure],
) -> FleetDecision | None:
    """`Stepping` when the step bound alone makes the request infeasible (module docstring), else None."""
    step = request.max_step_replicas
    if step is None:
        return None
    try:
        target = plan_fleet(
            request.model_copy(update={"max_step_replicas": None}), catalog, explain=False
        ).replicas()
    except (PlanInfeasible, CatalogError):
        return None
    replicas = {g: (min(target[g], x + step) if target.get(g, x) > x else x) for g, x in current.items()}
    if replicas == dict(current):
        return None
    reason = (
        f"no plan within {step} replica(s) per group of the current ones meets the constraints ({infeasible}); "
        f"the optimum without the step bound is {target}: the groups below it go up by at most {step}, "
        "none goes down; shares by the share policy"
    )
    return FleetDecision(
        "Stepping", "; ".join(p for p in (reason, out) if p), replicas, dict(current), figures=dict(figures)
    )
