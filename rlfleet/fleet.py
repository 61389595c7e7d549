"""Fleet economics: cost per usable token, and the fleet-mix optimizer (`rlfleet fleet plan FILE`).

PURE: no I/O except the CLI's reading of its file, no clock, no Kubernetes. docs/economics.md has the
formulation and the input file; the operator's rebalancer (operator/rebalance.py) sets shares only, this
module chooses replicas too.

- `cost_per_1m_usable_tokens` / `fleet_cost_per_1m_usable_tokens`: USD per million USABLE tokens (inside
  the MIS band: tokens outside it are masked by the objective and teach nothing, docs/objective.md) from
  tokens/s per replica, replicas, cost per replica-hour and out-of-range share.
- `weight_egress_cost_per_hour`: what a replica's weight traffic costs per hour where its group pays an
  egress price per GB (a group in another region than the store): bytes it reads per version x versions
  per hour x price; part of the group's cost per replica-hour wherever it is set.
- `measured_economics(groups, reference_accelerator)`: a running fleet's figures per interval (per group
  and fleet: tokens/s, USD/h, usable share, USD per 1M usable tokens; the reference's and the saving):
  the operator's rebalancer and a local run's report both take them from here. A reference class the
  fleet runs no bf16 group of is estimated from the other groups by the catalog's relative decode
  throughputs (`estimated_reference_tokens_per_gpu_second`), and says so (`reference_basis`).
- `plan_fleet(request)`: integer replicas per group minimising the fleet's cost per hour subject to
  usable tokens/s >= the trainer's demand, per-group and fleet-wide (token-weighted) mismatch budgets,
  replica bounds and a bounded change per interval, solved as a MILP with `scipy.optimize.milp`; then
  hysteresis (the current replicas stay unless the optimum saves more than a threshold), shares
  (throughput-proportional among the groups within budget), the binding constraints (those whose
  removal alone would make the plan cheaper) and the saving against a reference fleet (the trainer's
  accelerator at bf16). `PlanInfeasible` says which constraint no plan can meet.

Core module: imports nothing of the product packages but the catalog (and not kopf or torch); scipy is
imported when a plan is solved (the `operator` extra installs it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from rlfleet.catalog import Catalog, CatalogError, check_group, get_catalog
from rlfleet.yamlfile import read_yaml

SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9  # egress is priced per GB (10^9 bytes), as clouds bill it
ReferenceBasis = Literal["given", "measured", "estimated"]
REFERENCE_WEIGHT_FORMAT = "bf16"  # the trainer's own precision: the reference fleet makes tokens as it trains
_REL_TOL = 1e-9  # relative cost difference below which two plans cost the same (solver round-off)


# --- cost per usable token -------------------------------------------------------------------------


def cost_per_1m_usable_tokens(
    tokens_per_second_per_replica: float, replicas: int, cost_per_replica_hour: float, oor_fraction: float
) -> float | None:
    """USD per 1M usable tokens of `replicas` replicas, each making `tokens_per_second_per_replica`
    tokens/s at `cost_per_replica_hour` USD/h, a share `oor_fraction` of them outside the MIS band.
    None when the replicas make no usable token (no replica, no throughput, or every token out of band).
    The replica count cancels; it is an argument so that 0 replicas read as "no tokens", not a price."""
    return fleet_cost_per_1m_usable_tokens(
        [(tokens_per_second_per_replica, replicas, cost_per_replica_hour, oor_fraction)]
    )


def fleet_cost_per_1m_usable_tokens(groups: Iterable[tuple[float, int, float, float]]) -> float | None:
    """USD per 1M usable tokens of a fleet of groups (tokens/s per replica, replicas, cost per
    replica-hour, out-of-range share): the fleet's USD/h over its usable tokens/h. None: no usable token
    (or so few that the price overflows)."""
    dollars_per_hour = 0.0
    usable_per_second = 0.0
    for tokens_per_second, replicas, cost_per_hour, oor_fraction in groups:
        dollars_per_hour += cost_per_hour * replicas
        usable_per_second += tokens_per_second * replicas * (1.0 - oor_fraction)
    if usable_per_second <= 0.0:
        return None
    cost = dollars_per_hour / (usable_per_second * SECONDS_PER_HOUR) * 1e6
    # A subnormal rate overflows to inf (and inf / inf makes the rebalancer's cost shares NaN): no price.
    return cost if math.isfinite(cost) else None


def weight_egress_cost_per_hour(
    bytes_per_version: float, versions_per_hour: float, price_per_gb: float
) -> float:
    """USD per hour one replica pays for its weight traffic: the bytes it reads per version (its view's
    stored bytes: the whole view for an anchor, the payloads for a delta; with deltas, their mean over
    versions) x the versions published per hour x the egress price per GB (1e9 bytes)."""
    return bytes_per_version / BYTES_PER_GB * versions_per_hour * price_per_gb


# --- a running fleet's figures (the operator's rebalance interval, a local run's step) ------------------


@dataclass(frozen=True)
class MeasuredGroup:
    """One sampler group over one interval, as measured."""

    name: str
    accelerator: str
    weight_format: str
    gpus: int  # the GPUs it pays for (replicas x tensor parallelism)
    cost_per_gpu_hour: float  # USD (the catalog's, or its override's); 0: unknown
    tokens_per_second: float | None  # decode tokens/s; None: no reading yet
    oor_fraction: float | None  # share of its tokens outside the MIS band; None: not reported (counted as 0)
    # share of the tokens it sampled that the trainer trained on (the rest answered invalid: NaN, positive
    # or out-of-support logprobs, ...; trainer/metrics.py `trained_fraction`); None: not reported (all)
    trained_fraction: float | None = None
    # USD/h of the weight traffic of all its replicas (`weight_egress_cost_per_hour` x replicas; 0: none
    # priced): added to its GPUs' cost wherever their price is known
    egress_cost_per_hour: float = 0.0

    @property
    def cost_per_hour(self) -> float | None:
        """Its GPUs and its weight traffic, USD/h; None: no GPU price."""
        if self.cost_per_gpu_hour <= 0 or self.gpus <= 0:
            return None
        return self.cost_per_gpu_hour * self.gpus + max(self.egress_cost_per_hour, 0.0)

    @property
    def usable_fraction(self) -> float:
        """The share of its tokens that were trained on AND inside the MIS band (oor_fraction is a share of
        the trained ones)."""
        trained = min(max(self.trained_fraction if self.trained_fraction is not None else 1.0, 0.0), 1.0)
        return trained * (1.0 - min(max(self.oor_fraction or 0.0, 0.0), 1.0))


@dataclass(frozen=True)
class GroupEconomics:
    tokens_per_second: float | None
    cost_per_hour: float | None  # None: no price
    usable_fraction: float
    cost_per_1m_tokens: float | None  # every token, usable or not
    cost_per_1m_usable_tokens: float | None


@dataclass(frozen=True)
class FleetEconomics:
    """Per group and for the whole fleet: tokens/s, USD/h, the usable share of tokens, USD per 1M usable
    tokens; the reference fleet's USD per 1M usable tokens and the saving against it. None: unknown."""

    groups: dict[str, GroupEconomics]
    tokens_per_second: float
    cost_per_hour: float
    usable_fraction: float | None
    cost_per_1m_usable_tokens: float | None
    reference_accelerator: str
    reference_cost_per_1m_usable_tokens: float | None
    saving: float | None  # 1 - fleet / reference cost per usable token (negative: the fleet costs more)
    # where the reference's tokens/s per GPU came from (None: no reference): "given", "measured" on the
    # fleet's bf16 groups of its class, or "estimated" from the other groups by the catalog's ratios
    reference_basis: ReferenceBasis | None = None
    reference_tokens_per_gpu_second: float | None = None

    @property
    def reference_source(self) -> str | None:
        """One line saying what the reference is and whether its throughput is measured (status
        `baselineSource`, the local report's fleet line)."""
        if self.reference_basis is None:
            return None
        what = f"{self.reference_accelerator} {REFERENCE_WEIGHT_FORMAT}"
        return {
            "given": f"{what} at the given tokens/s per GPU",
            "measured": f"{what} measured on the fleet's {what} groups",
            "estimated": f"{what} estimated from catalog throughput ratios",
        }[self.reference_basis]


def _priced_cost_per_1m(g: MeasuredGroup, oor_fraction: float) -> float | None:
    cost = g.cost_per_hour
    if g.tokens_per_second is None or cost is None:
        return None
    return fleet_cost_per_1m_usable_tokens([(g.tokens_per_second, 1, cost, oor_fraction)])


def estimated_reference_tokens_per_gpu_second(
    groups: Sequence[MeasuredGroup],
    reference_accelerator: str,
    catalog: Catalog,
    weight_format: str = REFERENCE_WEIGHT_FORMAT,
) -> float | None:
    """Tokens/s per GPU of `reference_accelerator` at `weight_format` (default bf16: the reference fleet)
    as the measured groups imply it through the catalog's relative decode throughputs: a group of `gpus`
    GPUs making X tokens/s on class A at format p would make X * ratio(reference, format) / ratio(A, p) on
    as many reference GPUs; summed over the groups with a reading and a ratio, over their GPUs. None: no
    such group, or no ratio for the reference."""
    reference = catalog.decode_throughput(reference_accelerator, weight_format)
    tokens = 0.0
    gpus = 0
    for g in groups:
        ratio = catalog.decode_throughput(g.accelerator, g.weight_format)
        if reference is None or ratio is None or g.gpus <= 0 or (g.tokens_per_second or 0.0) <= 0:
            continue
        tokens += (g.tokens_per_second or 0.0) * reference / ratio
        gpus += g.gpus
    return tokens / gpus if gpus else None


def measured_economics(
    groups: Sequence[MeasuredGroup],
    reference_accelerator: str,
    reference_cost_per_gpu_hour: float | None = None,
    reference_tokens_per_gpu_second: float | None = None,
    reference_oor_fraction: float | None = None,
    catalog: Catalog | None = None,
) -> FleetEconomics:
    """The figures of a running fleet. The fleet pays every group's GPUs, also a group that makes no
    token. The reference fleet makes every token on `reference_accelerator` at bf16: at
    `reference_tokens_per_gpu_second` where given, else the tokens/s per GPU of the fleet's bf16 groups
    of that class, else (with a `catalog`) the estimate of `estimated_reference_tokens_per_gpu_second`;
    with `reference_oor_fraction` out of range where given, else those bf16 groups' share, else none; at
    `reference_cost_per_gpu_hour`, else the first such group's price, else the catalog's. No reference
    without a throughput and a price."""
    per_group = {
        g.name: GroupEconomics(
            tokens_per_second=g.tokens_per_second,
            cost_per_hour=g.cost_per_hour,
            usable_fraction=g.usable_fraction,
            cost_per_1m_tokens=_priced_cost_per_1m(g, 0.0),
            cost_per_1m_usable_tokens=_priced_cost_per_1m(g, 1.0 - g.usable_fraction),
        )
        for g in groups
    }
    paying = [g for g in groups if g.gpus > 0]
    tokens = sum(max(g.tokens_per_second or 0.0, 0.0) for g in paying)
    usable = sum(max(g.tokens_per_second or 0.0, 0.0) * g.usable_fraction for g in paying)
    fleet = None
    if any(g.cost_per_gpu_hour > 0 for g in paying):
        fleet = fleet_cost_per_1m_usable_tokens(
            [
                (max(g.tokens_per_second or 0.0, 0.0), 1, g.cost_per_hour or 0.0, 1.0 - g.usable_fraction)
                for g in paying
            ]
        )
    same = [
        g
        for g in paying
        if g.accelerator == reference_accelerator
        and g.weight_format == REFERENCE_WEIGHT_FORMAT
        and (g.tokens_per_second or 0.0) > 0
    ]
    per_gpu, oor = reference_tokens_per_gpu_second, reference_oor_fraction
    basis: ReferenceBasis = "given"
    if same:
        same_tokens = sum(g.tokens_per_second or 0.0 for g in same)
        if per_gpu is None:
            per_gpu, basis = same_tokens / sum(g.gpus for g in same), "measured"
        if oor is None:
            oor = 1.0 - sum((g.tokens_per_second or 0.0) * g.usable_fraction for g in same) / same_tokens
    if per_gpu is None and catalog is not None:
        per_gpu, basis = (
            estimated_reference_tokens_per_gpu_second(paying, reference_accelerator, catalog),
            "estimated",
        )
    price = reference_cost_per_gpu_hour
    if price is None and same:
        price = same[0].cost_per_gpu_hour
    if price is None and catalog is not None and reference_accelerator in catalog.classes:
        price = catalog.classes[reference_accelerator].cost_per_gpu_hour
    reference = None
    if price is not None and price > 0 and per_gpu:
        reference = fleet_cost_per_1m_usable_tokens([(per_gpu, 1, price, oor or 0.0)])
    return FleetEconomics(
        groups=per_group,
        tokens_per_second=tokens,
        cost_per_hour=sum(g.cost_per_hour or 0.0 for g in paying),
        usable_fraction=usable / tokens if tokens > 0 else None,
        cost_per_1m_usable_tokens=fleet,
        reference_accelerator=reference_accelerator,
        reference_cost_per_1m_usable_tokens=reference,
        saving=1.0 - fleet / reference if fleet is not None and reference else None,
        reference_basis=basis if reference is not None else None,
        reference_tokens_per_gpu_second=per_gpu if reference is not None else None,
    )


# --- the input (the file `rlfleet fleet plan` reads) -------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class GroupFigures(_Model):
    """One sampler group as measured: throughput and mismatch, its cost and its replica bounds."""

    name: str = Field(min_length=1)
    accelerator: str  # a catalog class: the cost per GPU-hour when costPerReplicaHour is not given
    weight_format: str = "bf16"
    gpus_per_replica: int = Field(default=1, ge=1, le=8)  # tensor parallelism
    cost_per_replica_hour: float | None = Field(default=None, ge=0.0)  # USD; default: catalog x gpus
    tokens_per_second_per_replica: float = Field(gt=0.0)  # measured decode tokens/s of one busy replica
    kl: float = Field(ge=0.0)  # the trainer's kl_k3 for this group's tokens
    oor_fraction: float = Field(ge=0.0, le=1.0)  # share of its tokens outside the MIS band
    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(ge=0)
    replicas: int | None = Field(default=None, ge=0)  # current replicas (hysteresis, change bound)
    max_kl: float | None = Field(default=None, ge=0.0)  # this group's budget (default: budgets.groupMaxKl)
    max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    spot: bool = False  # spot capacity: among the cheapest plans, the one with the fewest spot replicas
    # its weight traffic, where it pays for it (a group in another region than the store): USD per GB its
    # replicas read, and the bytes one replica reads per version (its view's stored bytes; with deltas the
    # mean over versions); with the request's versionsPerHour, part of its cost per replica-hour
    egress_price_per_gb: float | None = Field(default=None, ge=0.0, le=1000.0)
    weight_bytes_per_version: float | None = Field(default=None, ge=0.0, le=1e15)
    # or that cost as measured, USD per replica-hour (the operator: the rate of its view's stored bytes x
    # its egress price, operator/rebalance.py `replica_egress_cost_per_hour`), instead of the two above
    egress_cost_per_replica_hour: float | None = Field(default=None, ge=0.0)

    @model_validator(mode="after")
    def _check_bounds(self) -> GroupFigures:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas {self.min_replicas} > maxReplicas {self.max_replicas}")
        if self.egress_cost_per_replica_hour is not None and (
            self.egress_price_per_gb or self.weight_bytes_per_version is not None
        ):
            raise ValueError(
                "egressCostPerReplicaHour (measured) or egressPricePerGb with weightBytesPerVersion, not both"
            )
        return self


class Budgets(_Model):
    """Mismatch budgets: per group (a group over its own is given no share and drained) and fleet-wide,
    token-weighted over the groups that get a share."""

    max_kl: float | None = Field(default=None, ge=0.0)
    max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    group_max_kl: float | None = Field(default=None, ge=0.0)
    group_max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)


class Demand(_Model):
    """What the trainer consumes at its target staleness: usable tokens per step / seconds per step."""

    usable_tokens_per_second: float = Field(ge=0.0)


class Reference(_Model):
    """The fleet the saving is measured against: every token made on one class at bf16. Default: the
    trainer's accelerator, its throughput and out-of-range share from a group of that class at bf16."""

    accelerator: str | None = None  # default: trainerAccelerator
    gpus_per_replica: int = Field(default=1, ge=1, le=8)
    cost_per_replica_hour: float | None = Field(default=None, ge=0.0)
    tokens_per_second_per_replica: float | None = Field(default=None, gt=0.0)
    oor_fraction: float | None = Field(default=None, ge=0.0, lt=1.0)


class FleetPlanRequest(_Model):
    """The input of one planning step."""

    trainer_accelerator: str = "b200"
    demand: Demand
    budgets: Budgets = Field(default_factory=Budgets)
    max_step_replicas: int | None = Field(default=None, ge=1)  # per group per interval (needs `replicas`)
    hysteresis: float = Field(default=0.05, ge=0.0, lt=1.0)  # the relative cost gain a change must beat
    groups: list[GroupFigures] = Field(min_length=1)
    reference: Reference = Field(default_factory=Reference)
    versions_per_hour: float | None = Field(
        default=None, ge=0.0, le=1e6
    )  # weight versions published per hour

    @model_validator(mode="after")
    def _check_names(self) -> FleetPlanRequest:
        names = [g.name for g in self.groups]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate group names: {', '.join(duplicates)}")
        for g in self.groups:
            if g.egress_price_per_gb and (
                g.weight_bytes_per_version is None or self.versions_per_hour is None
            ):
                raise ValueError(
                    f"group {g.name}: egressPricePerGb needs its weightBytesPerVersion and the request's "
                    "versionsPerHour (the weight traffic it pays for)"
                )
        return self


# --- the output -------------------------------------------------------------------------------------


class PlanInfeasible(ValueError):
    """No replica counts meet the demand, the budgets and the bounds; the message says which."""


@dataclass(frozen=True)
class Binding:
    """A constraint whose removal alone would make the plan cheaper."""

    constraint: (
        str  # demand | fleetMaxKl | fleetMaxOorFraction | maxStep | maxReplicas | minReplicas | groupBudget
    )
    # (the first four are fleet-wide: group None)
    group: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"constraint": self.constraint, "group": self.group, "message": self.message}


@dataclass(frozen=True)
class GroupPlan:
    name: str
    replicas: int
    current_replicas: int | None
    share: float
    within_budget: bool
    tokens_per_second: float  # at the planned replicas, every replica busy
    usable_tokens_per_second: float  # 0 for a group over its budget (no share)
    cost_per_hour: float  # its GPUs and its weight traffic
    cost_per_1m_usable_tokens: float | None  # the group's own price of a usable token
    egress_cost_per_hour: float = 0.0  # the weight traffic's share of cost_per_hour


@dataclass(frozen=True)
class FleetPlan:
    decision: str  # "optimal" | "kept"
    reason: str
    groups: tuple[GroupPlan, ...]
    cost_per_hour: float
    usable_tokens_per_second: float
    cost_per_1m_usable_tokens: float | None
    kl: float | None  # token-weighted over the groups with a share
    oor_fraction: float | None
    optimal_cost_per_hour: float
    reference_accelerator: str
    reference_cost_per_1m_usable_tokens: float
    saving: float | None  # 1 - fleet / reference cost per usable token
    binding: tuple[Binding, ...]

    def replicas(self) -> dict[str, int]:
        return {g.name: g.replicas for g in self.groups}

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "reason": self.reason,
            "groups": {
                g.name: {
                    "replicas": g.replicas,
                    "currentReplicas": g.current_replicas,
                    "share": _round(g.share, 6),
                    "withinBudget": g.within_budget,
                    "tokensPerSecond": _round(g.tokens_per_second, 3),
                    "usableTokensPerSecond": _round(g.usable_tokens_per_second, 3),
                    "costPerHour": _round(g.cost_per_hour, 6),
                    "costPer1MUsableTokens": _round(g.cost_per_1m_usable_tokens, 6),
                    **(
                        {"egressCostPerHour": _round(g.egress_cost_per_hour, 6)}
                        if g.egress_cost_per_hour
                        else {}
                    ),
                }
                for g in self.groups
            },
            "fleet": {
                "replicas": sum(g.replicas for g in self.groups),
                "costPerHour": _round(self.cost_per_hour, 6),
                "usableTokensPerSecond": _round(self.usable_tokens_per_second, 3),
                "costPer1MUsableTokens": _round(self.cost_per_1m_usable_tokens, 6),
                "kl": _round(self.kl, 9),
                "oorFraction": _round(self.oor_fraction, 9),
                "optimalCostPerHour": _round(self.optimal_cost_per_hour, 6),
            },
            "reference": {
                "accelerator": self.reference_accelerator,
                "weightFormat": REFERENCE_WEIGHT_FORMAT,
                "costPer1MUsableTokens": _round(self.reference_cost_per_1m_usable_tokens, 6),
                "saving": _round(self.saving, 6),
            },
            "binding": [b.to_dict() for b in self.binding],
        }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


# --- the MILP -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    """A group as the solver sees it (resolved cost, budget verdict, replica bounds)."""

    name: str
    tokens_per_second: float  # per replica
    cost_per_hour: float  # per replica: its GPUs and its weight traffic
    kl: float
    oor_fraction: float
    within_budget: bool
    over_budget_reason: str
    current: int | None
    min_replicas: int
    max_replicas: int
    spot: bool = False
    egress_cost_per_replica_hour: float = 0.0  # included in cost_per_hour

    @property
    def usable_per_replica(self) -> float:
        return self.tokens_per_second * (1.0 - self.oor_fraction) if self.within_budget else 0.0


@dataclass(frozen=True)
class _Problem:
    """One MILP instance; the relaxations used to find binding constraints are copies of it."""

    groups: tuple[_Group, ...]
    demand: float
    fleet_max_kl: float | None
    fleet_max_oor: float | None
    max_step: int | None

    def bounds(self, g: _Group) -> tuple[int, int]:
        """Replica bounds: [min, max] (a group over its budget: [0, 0], it gets no share and its minimum
        does not hold), narrowed to current +- max_step; when the two do not meet (bounds moved, or a
        group went over budget), the step toward them: no group moves more than max_step per interval."""
        low, high = (g.min_replicas, g.max_replicas) if g.within_budget else (0, 0)
        if self.max_step is None or g.current is None:
            return low, high
        down, up = g.current - self.max_step, g.current + self.max_step
        if up < low:
            return up, up
        if down > high:
            return down, down
        return max(low, down), min(high, up)

    def satisfied_by(self, replicas: Sequence[int]) -> bool:
        """Whether integer replicas meet every constraint of this problem (bounds included)."""
        for g, x in zip(self.groups, replicas, strict=True):
            low, high = self.bounds(g)
            if not low <= x <= high:
                return False
        return all(
            value <= limit + _REL_TOL * max(abs(limit), 1.0) for value, limit in self._rows_at(replicas)
        )

    def _rows_at(self, replicas: Sequence[int]) -> list[tuple[float, float]]:
        """(value, limit) of each linear constraint written as value <= limit."""
        rows = [
            (-sum(g.usable_per_replica * x for g, x in zip(self.groups, replicas, strict=True)), -self.demand)
        ]
        for attr, budget in (("kl", self.fleet_max_kl), ("oor_fraction", self.fleet_max_oor)):
            if budget is not None:
                value = sum(
                    g.tokens_per_second * x * (getattr(g, attr) - budget)
                    for g, x in zip(self.groups, replicas, strict=True)
                    if g.within_budget
                )
                rows.append((value, 0.0))
        return rows


def _cost(problem: _Problem, replicas: Sequence[int]) -> float:
    return sum(g.cost_per_hour * x for g, x in zip(problem.groups, replicas, strict=True))


def _solve(problem: _Problem) -> tuple[int, ...] | None:
    """The cheapest integer replicas meeting the problem's constraints (None: infeasible).

    minimise   sum_i c_i x_i                                    (USD per hour)
    subject to sum_i t_i (1 - o_i) x_i >= D                     (usable tokens/s, groups within budget)
               sum_i t_i (k_i - K) x_i <= 0                     (fleet token-weighted KL <= K)
               sum_i t_i (o_i - O) x_i <= 0                     (fleet token-weighted out-of-range <= O)
               l_i <= x_i <= u_i, x_i integer                   (bounds, change bound, group budgets)

    With spot groups, a second MILP breaks ties: the fewest spot replicas among the plans of that cost
    (sum_{i spot} x_i minimised with sum_i c_i x_i <= C*), so when the demand falls a spot group's
    replicas go before an on-demand group's of the same cost per usable token (a reclaim can come any
    time; the same price is safer on-demand)."""
    cheapest = _solve_milp(problem, None)
    if cheapest is None or not any(g.spot for g in problem.groups):
        return cheapest
    cost = _cost(problem, cheapest)
    fewest_spot = _solve_milp(problem, cost + _REL_TOL * max(cost, 1.0))
    if fewest_spot is None or _cost(problem, fewest_spot) > cost + _REL_TOL * max(cost, 1.0):
        return cheapest  # the solver's tolerance let it past the cost: the first answer stands
    return fewest_spot


def _solve_milp(problem: _Problem, max_cost: float | None) -> tuple[int, ...] | None:
    """One MILP: the cheapest plan (max_cost None), or the fewest spot replicas costing <= max_cost."""
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(problem.groups)
    low, high = zip(*(problem.bounds(g) for g in problem.groups), strict=True)
    rows = [[g.usable_per_replica for g in problem.groups]]
    lower = [problem.demand]
    upper = [np.inf]
    for attr, budget in (("kl", problem.fleet_max_kl), ("oor_fraction", problem.fleet_max_oor)):
        if budget is not None:
            rows.append(
                [
                    g.tokens_per_second * (getattr(g, attr) - budget) if g.within_budget else 0.0
                    for g in problem.groups
                ]
            )
            lower.append(-np.inf)
            upper.append(0.0)
    objective = [g.cost_per_hour for g in problem.groups]
    if max_cost is not None:
        rows.append(objective)
        lower.append(-np.inf)
        upper.append(max_cost)
        objective = [1.0 if g.spot else 0.0 for g in problem.groups]
    result = milp(
        c=np.array(objective),
        integrality=np.ones(n),
        bounds=Bounds(np.array(low, dtype=float), np.array(high, dtype=float)),
        constraints=LinearConstraint(np.array(rows), np.array(lower), np.array(upper)),
    )
    if result.status != 0 or result.x is None:
        return None
    replicas = tuple(int(round(v)) for v in result.x)
    # The solver's answer, rounded, must meet the constraints exactly as stated (not within its tolerance).
    return replicas if problem.satisfied_by(replicas) else None


# --- the plan ------------------------------------------------------------------------------------------


def plan_fleet(request: FleetPlanRequest, catalog: Catalog | None = None, explain: bool = True) -> FleetPlan:
    """One planning step (module docstring). Raises PlanInfeasible, or CatalogError for a class or
    format the catalog does not have. `explain=False` leaves `binding` empty: the binding constraints
    cost one more MILP per constraint (about 2 per group), the decision itself one."""
    cat = catalog or get_catalog()
    groups = tuple(_resolve_group(g, request, cat) for g in request.groups)
    problem = _Problem(
        groups=groups,
        demand=request.demand.usable_tokens_per_second,
        fleet_max_kl=request.budgets.max_kl,
        fleet_max_oor=request.budgets.max_oor_fraction,
        max_step=request.max_step_replicas,
    )
    optimum = _solve(problem)
    if optimum is None:
        raise PlanInfeasible(_infeasible_reason(problem))
    optimal_cost = _cost(problem, optimum)
    chosen, decision, reason = _apply_hysteresis(problem, optimum, optimal_cost, request.hysteresis)
    binding = tuple(_binding_constraints(problem, optimal_cost)) if explain else ()
    ref_accelerator, ref_cost = _reference_cost(request, groups, cat)
    return _fleet_plan(problem, chosen, decision, reason, optimal_cost, binding, ref_accelerator, ref_cost)


def _resolve_group(g: GroupFigures, request: FleetPlanRequest, catalog: Catalog) -> _Group:
    check_group(g.accelerator, g.weight_format, catalog=catalog)  # CatalogError: a class that cannot run it
    cost = g.cost_per_replica_hour
    if cost is None:
        cost = catalog.get(g.accelerator).cost_per_gpu_hour * g.gpus_per_replica
    egress = g.egress_cost_per_replica_hour or 0.0
    if (
        g.egress_price_per_gb
        and g.weight_bytes_per_version is not None
        and request.versions_per_hour is not None
    ):
        egress = weight_egress_cost_per_hour(
            g.weight_bytes_per_version, request.versions_per_hour, g.egress_price_per_gb
        )
    max_kl = g.max_kl if g.max_kl is not None else request.budgets.group_max_kl
    max_oor = g.max_oor_fraction if g.max_oor_fraction is not None else request.budgets.group_max_oor_fraction
    over = []
    if max_kl is not None and g.kl > max_kl:
        over.append(f"KL {g.kl:g} > {max_kl:g}")
    if max_oor is not None and g.oor_fraction > max_oor:
        over.append(f"out-of-range share {g.oor_fraction:g} > {max_oor:g}")
    return _Group(
        name=g.name,
        tokens_per_second=g.tokens_per_second_per_replica,
        cost_per_hour=cost + egress,
        kl=g.kl,
        oor_fraction=g.oor_fraction,
        within_budget=not over,
        over_budget_reason=", ".join(over),
        current=g.replicas,
        min_replicas=g.min_replicas,
        max_replicas=g.max_replicas,
        spot=g.spot,
        egress_cost_per_replica_hour=egress,
    )


def _apply_hysteresis(
    problem: _Problem, optimum: tuple[int, ...], optimal_cost: float, hysteresis: float
) -> tuple[tuple[int, ...], str, str]:
    """The current replicas when every group has them, they meet every constraint and the optimum
    saves no more than `hysteresis` of their cost; else the optimum."""
    current = tuple(g.current for g in problem.groups)
    if any(x is None for x in current):
        return optimum, "optimal", "no current replicas for every group: the optimum"
    current_replicas = tuple(int(x) for x in current if x is not None)
    if current_replicas == optimum:
        return optimum, "optimal", "the current replicas are the optimum"
    if not problem.satisfied_by(current_replicas):
        return optimum, "optimal", "the current replicas break a constraint: the optimum"
    current_cost = _cost(problem, current_replicas)
    gain = (current_cost - optimal_cost) / current_cost if current_cost > 0 else 0.0
    if gain <= hysteresis:
        return (
            current_replicas,
            "kept",
            (
                f"the optimum saves {gain:.2%} of ${current_cost:.2f}/h, not more than the hysteresis {hysteresis:.2%}"
            ),
        )
    return (
        optimum,
        "optimal",
        f"the optimum saves {gain:.2%} of ${current_cost:.2f}/h (> hysteresis {hysteresis:.2%})",
    )


def _relaxations(problem: _Problem) -> list[tuple[str, str | None, _Problem]]:
    """Each constraint of the problem with the copy of the problem that lacks it alone."""
    out: list[tuple[str, str | None, _Problem]] = [("demand", None, replace(problem, demand=0.0))]
    if problem.fleet_max_kl is not None:
        out.append(("fleetMaxKl", None, replace(problem, fleet_max_kl=None)))
    if problem.fleet_max_oor is not None:
        out.append(("fleetMaxOorFraction", None, replace(problem, fleet_max_oor=None)))
    if problem.max_step is not None:  # one setting for every group: often binding only as a whole
        out.append(("maxStep", None, replace(problem, max_step=None)))
    for i, g in enumerate(problem.groups):

        def without(changed: _Group, i: int = i) -> _Problem:
            return replace(problem, groups=problem.groups[:i] + (changed,) + problem.groups[i + 1 :])

        if not g.within_budget:
            out.append(("groupBudget", g.name, without(replace(g, within_budget=True))))
            continue
        out.append(("maxReplicas", g.name, without(replace(g, max_replicas=10**6))))
        if g.min_replicas > 0:
            out.append(("minReplicas", g.name, without(replace(g, min_replicas=0))))
    return out


def _binding_constraints(problem: _Problem, optimal_cost: float) -> list[Binding]:
    """The constraints whose removal alone lowers the optimal cost."""
    out = []
    for constraint, group, relaxed in _relaxations(problem):
        cheaper = _solve(relaxed)
        if cheaper is None:
            continue
        relaxed_cost = _cost(relaxed, cheaper)
        if relaxed_cost < optimal_cost - _REL_TOL * max(optimal_cost, 1.0):
            out.append(
                Binding(
                    constraint,
                    group,
                    _binding_message(problem, constraint, group, optimal_cost - relaxed_cost),
                )
            )
    return out


def _binding_message(problem: _Problem, constraint: str, group: str | None, saving: float) -> str:
    g = next((x for x in problem.groups if x.name == group), None)
    without = f"without it the plan would cost ${saving:.2f}/h less"
    if g is None:
        what = {
            "demand": f"usable tokens/s >= {problem.demand:g}",
            "fleetMaxKl": f"fleet token-weighted KL <= {problem.fleet_max_kl}",
            "fleetMaxOorFraction": f"fleet token-weighted out-of-range share <= {problem.fleet_max_oor}",
            "maxStep": f"at most {problem.max_step} replicas added or removed per group per interval",
        }[constraint]
        return f"{what}: {without}"
    what = {
        "maxReplicas": f"at most {g.max_replicas} replicas",
        "minReplicas": f"at least {g.min_replicas} replicas",
        "groupBudget": f"over its mismatch budget ({g.over_budget_reason}): no share",
    }[constraint]
    return f"{g.name}: {what}: {without}"


def _infeasible_reason(problem: _Problem) -> str:
    """Why no plan meets the problem: the most usable tokens/s the bounds allow, and each single
    constraint whose removal would make a plan possible."""
    most = sum(g.usable_per_replica * problem.bounds(g)[1] for g in problem.groups)
    parts = [
        f"demand {problem.demand:g} usable tokens/s; the groups within budget make at most {most:g} "
        "at their replica bounds"
    ]
    over = [f"{g.name} ({g.over_budget_reason})" for g in problem.groups if not g.within_budget]
    if over:
        parts.append(f"over their own budget (no share): {', '.join(over)}")
    fixes = [
        constraint if group is None else f"{constraint} of {group}"
        for constraint, group, relaxed in _relaxations(problem)
        if constraint != "demand" and _solve(relaxed) is not None
    ]
    if fixes:
        parts.append(f"a plan exists without: {', '.join(fixes)}")
    return "no plan meets the budgets: " + "; ".join(parts)


def _reference_cost(
    request: FleetPlanRequest, groups: Sequence[_Group], catalog: Catalog
) -> tuple[str, float]:
    """(accelerator, USD per 1M usable tokens) of the reference fleet: the reference's figures, else a
    bf16 group of its class in the request, else CatalogError saying what to give."""
    ref = request.reference
    accelerator = ref.accelerator or request.trainer_accelerator
    check_group(accelerator, REFERENCE_WEIGHT_FORMAT, catalog=catalog)
    same = [
        (figures, resolved)
        for figures, resolved in zip(request.groups, groups, strict=True)
        if figures.accelerator == accelerator and figures.weight_format == REFERENCE_WEIGHT_FORMAT
    ]
    tokens, oor, cost = ref.tokens_per_second_per_replica, ref.oor_fraction, ref.cost_per_replica_hour
    if same and tokens is None:  # the group's figures, per replica of its size and at its GPUs' cost
        _, resolved = same[0]  # (the reference is next to the store: it pays no weight traffic)
        tokens = resolved.tokens_per_second
        oor = resolved.oor_fraction if oor is None else oor
        cost = resolved.cost_per_hour - resolved.egress_cost_per_replica_hour if cost is None else cost
    if tokens is None:
        raise CatalogError(
            f"reference: no group runs {accelerator} at {REFERENCE_WEIGHT_FORMAT}; give "
            "reference.tokensPerSecondPerReplica (the measured or estimated bf16 tokens/s of one replica)"
        )
    if cost is None:
        cost = catalog.get(accelerator).cost_per_gpu_hour * ref.gpus_per_replica
    price = cost_per_1m_usable_tokens(tokens, 1, cost, oor or 0.0)
    if price is None:  # tokens > 0 and oor < 1 by the model's bounds
        raise CatalogError("reference: makes no usable token")
    return accelerator, price


def _fleet_plan(
    problem: _Problem,
    replicas: tuple[int, ...],
    decision: str,
    reason: str,
    optimal_cost: float,
    binding: tuple[Binding, ...],
    reference_accelerator: str,
    reference_cost: float,
) -> FleetPlan:
    shares = _shares(problem.groups, replicas)
    served = [(g, x) for g, x in zip(problem.groups, replicas, strict=True) if g.within_budget and x > 0]
    tokens = sum(g.tokens_per_second * x for g, x in served)
    fleet_cost = fleet_cost_per_1m_usable_tokens(
        (g.tokens_per_second if g.within_budget else 0.0, x, g.cost_per_hour, g.oor_fraction)
        for g, x in zip(problem.groups, replicas, strict=True)
    )
    group_plans = tuple(
        GroupPlan(
            name=g.name,
            replicas=x,
            current_replicas=g.current,
            share=shares[g.name],
            within_budget=g.within_budget,
            tokens_per_second=g.tokens_per_second * x,
            usable_tokens_per_second=g.usable_per_replica * x,
            cost_per_hour=g.cost_per_hour * x,
            cost_per_1m_usable_tokens=cost_per_1m_usable_tokens(
                g.tokens_per_second, 1, g.cost_per_hour, g.oor_fraction
            ),
            egress_cost_per_hour=g.egress_cost_per_replica_hour * x,
        )
        for g, x in zip(problem.groups, replicas, strict=True)
    )
    return FleetPlan(
        decision=decision,
        reason=reason,
        groups=group_plans,
        cost_per_hour=_cost(problem, replicas),
        usable_tokens_per_second=sum(g.usable_per_replica * x for g, x in served),
        cost_per_1m_usable_tokens=fleet_cost,
        kl=sum(g.tokens_per_second * x * g.kl for g, x in served) / tokens if tokens > 0 else None,
        oor_fraction=sum(g.tokens_per_second * x * g.oor_fraction for g, x in served) / tokens
        if tokens > 0
        else None,
        optimal_cost_per_hour=optimal_cost,
        reference_accelerator=reference_accelerator,
        reference_cost_per_1m_usable_tokens=reference_cost,
        saving=1.0 - fleet_cost / reference_cost if fleet_cost is not None and reference_cost > 0 else None,
        binding=binding,
    )


def _shares(groups: Sequence[_Group], replicas: Sequence[int]) -> dict[str, float]:
    """Routing shares: proportional to the throughput of the replicas of groups within budget."""
    weights = {
        g.name: (g.tokens_per_second * x if g.within_budget else 0.0)
        for g, x in zip(groups, replicas, strict=True)
    }
    total = sum(weights.values())
    return {name: (w / total if total > 0 else 0.0) for name, w in weights.items()}


# --- the command -----------------------------------------------------------------------------------------


def load_request(path: Path) -> FleetPlanRequest:
    """The request in a YAML or JSON file (JSON is YAML); ValueError with a one-line reason."""
    return request_from_mapping(read_yaml(path))


def request_from_mapping(data: Any) -> FleetPlanRequest:
    if not isinstance(data, Mapping):
        raise ValueError("expected a mapping (trainerAccelerator, demand, budgets, groups, ...)")
    try:
        return FleetPlanRequest.model_validate(data)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(errors) from None


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlfleet fleet plan",
        description="Choose replicas and shares per sampler group to minimise the cost per usable token "
        "under mismatch budgets (docs/economics.md). Prints the plan as JSON; exit 2 when no plan meets "
        "the budgets or the input is bad.",
    )
    parser.add_argument(
        "file", type=Path, help="groups' measured figures, costs, bounds, budgets and demand (YAML or JSON)"
    )
    args = parser.parse_args(argv)
    prog = "rlfleet fleet plan"
    try:
        request = load_request(args.file)
        plan = plan_fleet(request)
    except (ValueError, CatalogError) as exc:  # PlanInfeasible and CatalogError are ValueErrors
        print(f"{prog}: {args.file}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"{prog}: needs scipy ({exc}): pip install 'rlfleet[operator]'", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=2))
    return 0
