"""The router's part of an RLJob's spec: how shares are set (the share policy), the fleet-mix optimizer
(replicas), the precision autopilot (weight formats) and the reference fleet savings are measured
against (docs/router.md, docs/economics.md).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from rlfleet.api.common import DNS_SUBDOMAIN_PATTERN, HTTP_URL_PATTERN, ApiModel, RouterPolicy, cel_rules
from rlfleet.api.podfields import POD_FIELDS_RULES
from rlfleet.api.scheduling import PodPlacement

STATIC_SHARES_RULE = "self.policy != 'static' || size(self.staticShares) > 0"
STATIC_SHARES_MESSAGE = "router: policy static needs staticShares"
STATIC_SHARES_POSITIVE_RULE = "!has(self.staticShares) || size(self.staticShares) == 0 || self.staticShares.exists(k, self.staticShares[k] > 0.0)"
STATIC_SHARES_POSITIVE_MESSAGE = "router.staticShares: at least one share must be > 0"
STATIC_SHARES_GROUPS_RULE = "!has(self.router.staticShares) || self.router.staticShares.all(k, self.samplerGroups.exists(g, g.name == k))"
STATIC_SHARES_GROUPS_MESSAGE = "router.staticShares: every key must be the name of a group in samplerGroups"


class ReferenceFleetSpec(ApiModel):
    """The fleet the saving per usable token is measured against: every token made on one class in BF16."""

    accelerator: str | None = Field(
        default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    """Its accelerator class (default: trainer.accelerator); it must run BF16."""
    tokens_per_gpu_second: float | None = Field(default=None, gt=0.0, le=1e9)
    """Its BF16 decode tokens/s per GPU (default: measured on the job's BF16 groups of that class, else estimated from the other groups through the catalog's decodeThroughput ratios; status.baselineSource says which)."""
    oor_fraction: float | None = Field(default=None, ge=0.0, lt=1.0)
    """Share of its tokens outside the MIS band (default: that of the job's BF16 groups of the class, else 0)."""
    cost_per_gpu_hour: float | None = Field(default=None, gt=0.0, le=1e6)
    """USD per GPU-hour (default: the catalog's price of the class)."""

    @model_validator(mode="after")
    def _check_class(self) -> ReferenceFleetSpec:
        if self.accelerator is not None:
            from rlfleet import catalog

            try:
                catalog.check_group(self.accelerator, "bf16")
            except (catalog.CatalogError, KeyError) as exc:
                raise ValueError(f"router.reference.accelerator: {exc}") from None
        return self


FLEET_BOUNDS_RULE = "self.minReplicas <= self.maxReplicas"
FLEET_BOUNDS_MESSAGE = "router.optimize.groups: minReplicas must be <= maxReplicas"
FLEET_DEMAND_RULE = "!self.enabled || has(self.demand)"
FLEET_DEMAND_MESSAGE = "router.optimize: enabled needs demand.usableTokensPerSecond (what the trainer consumes), or demand: {} to derive it from the trainer's steps"
FLEET_GROUPS_RULE = "!has(self.router.optimize) || !has(self.router.optimize.groups) || self.router.optimize.groups.all(k, self.samplerGroups.exists(g, g.name == k))"
FLEET_GROUPS_MESSAGE = "router.optimize.groups: every key must be the name of a group in samplerGroups"


class FleetGroupBounds(ApiModel):
    """One group's replica bounds and mismatch budget for the fleet-mix optimizer."""

    model_config = cel_rules({"rule": FLEET_BOUNDS_RULE, "message": FLEET_BOUNDS_MESSAGE})

    min_replicas: int = Field(default=0, ge=0, le=1024)
    """Fewest replicas the optimizer leaves the group (not held while the group is over its own mismatch budget: it is drained)."""
    max_replicas: int = Field(ge=0, le=1024)
    """Most replicas the optimizer gives the group."""
    max_kl: float | None = Field(default=None, ge=0.0, le=1e6)
    """The group's own KL budget (the trainer's kl_k3 of its tokens); default: budgets.groupMaxKl."""
    max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """The group's own budget of tokens outside the MIS band; default: budgets.groupMaxOorFraction."""

    @model_validator(mode="after")
    def _check_bounds(self) -> FleetGroupBounds:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"{FLEET_BOUNDS_MESSAGE} (got {self.min_replicas} > {self.max_replicas})")
        return self


class FleetBudgetsSpec(ApiModel):
    """Mismatch budgets of the fleet-mix optimizer (none: unbounded)."""

    max_kl: float | None = Field(default=None, ge=0.0, le=1e6)
    """Fleet-wide KL budget, token-weighted over the groups with a share."""
    max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Fleet-wide budget of the share of tokens outside the MIS band, token-weighted."""
    group_max_kl: float | None = Field(default=None, ge=0.0, le=1e6)
    """Each group's KL budget (a group over it gets no share and is drained to 0 replicas)."""
    group_max_oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Each group's budget of tokens outside the MIS band."""


class FleetDemandSpec(ApiModel):
    """What the trainer consumes."""

    usable_tokens_per_second: float | None = Field(default=None, ge=0.0, le=1e9)
    """Usable (in-band) tokens per second the sampler fleet must make. Unset: derived each interval from the trainer's last step, as the tokens it samples per step (episodes x mean response length) over its training seconds per step, times the in-band share (1 - its out-of-range share), times headroom: the rate at which the trainer, never waiting on rollouts, consumes them (docs/economics.md)."""
    headroom: float = Field(default=1.1, ge=1.0, le=4.0)
    """The derived demand's margin over the trainer's consumption (unused when usableTokensPerSecond is given)."""


class FleetOptimizeSpec(ApiModel):
    """The fleet-mix optimizer (docs/economics.md): each rebalance interval, replicas and shares per group that minimise the cost per usable token under the demand, the mismatch budgets and the bounds. Replicas go through each SamplerGroup's scale subresource; the RLJob's spec is never written."""

    model_config = cel_rules({"rule": FLEET_DEMAND_RULE, "message": FLEET_DEMAND_MESSAGE})

    enabled: bool = False
    """Off (default): the share policy sets shares and replicas stay as the spec says."""
    demand: FleetDemandSpec | None = None
    """The trainer's demand (needed when enabled)."""
    budgets: FleetBudgetsSpec = Field(default_factory=FleetBudgetsSpec, json_schema_extra={"default": {}})
    """Mismatch budgets."""
    groups: dict[str, FleetGroupBounds] = Field(default_factory=dict, max_length=32)
    """Replica bounds per group name; a group not named here keeps its replicas (it still counts toward the demand)."""
    max_step_replicas: int = Field(default=1, ge=1, le=1024)
    """Most replicas a group gains or loses per rebalance interval."""
    hysteresis: float = Field(default=0.05, ge=0.0, lt=1.0)
    """The current replicas stay unless the optimum saves more than this share of their cost per hour."""

    @model_validator(mode="after")
    def _check_demand(self) -> FleetOptimizeSpec:
        if self.enabled and self.demand is None:
            raise ValueError(FLEET_DEMAND_MESSAGE)
        return self


AUTOPILOT_COOLDOWN_RULE = "self.cooldownIntervals <= self.maxCooldownIntervals"
AUTOPILOT_COOLDOWN_MESSAGE = "router.autopilot: cooldownIntervals must be <= maxCooldownIntervals"


class PrecisionAutopilotSpec(ApiModel):
    """The precision autopilot (docs/economics.md): a group over its own mismatch budget (router.optimize.groups[name].maxKl / maxOorFraction, else router.optimize.budgets.groupMaxKl / groupMaxOorFraction) moves one step up nvfp4 -> fp8 -> bf16 within what its class runs and the weight channel publishes, or is quarantined at the top (a group answering invalid tokens over maxInvalidFraction is quarantined at once); within its budget for a cool-down it steps back down, never below the RLJob's own weightFormat. Set on the SamplerGroup; the RLJob's spec is never written."""

    model_config = cel_rules({"rule": AUTOPILOT_COOLDOWN_RULE, "message": AUTOPILOT_COOLDOWN_MESSAGE})

    enabled: bool = False
    """Off (default): a group's weightFormat is the RLJob's."""
    patience: int = Field(default=3, ge=1, le=1000)
    """Rebalance intervals in a row a group must be over its budget before it moves; also the intervals after a move before it is judged again (its pods restart, and the trainer's figures still hold the old format's tokens)."""
    step_down: bool = True
    """A group the autopilot moved up tries the next cheaper format again (never below the RLJob's own weightFormat) after it has stayed within its budget for cooldownIntervals; false: never down."""
    cooldown_intervals: int = Field(default=20, ge=1, le=100000)
    """Judged rebalance intervals in a row (the trainer reported, none over budget) before a step down; a step down that breaches within as many intervals at the cheaper format goes back up and doubles the group's cool-down."""
    max_cooldown_intervals: int = Field(default=320, ge=1, le=100000)
    """The bound of the doubled cool-down: a group that keeps breaching at the cheaper format tries it again at most once per this many intervals."""
    max_invalid_fraction: float = Field(default=0.05, ge=0.0, le=1.0)
    """A group whose share of sampled tokens the trainer could not train on (invalid answers: NaN, positive or out-of-support logprobs, wrong lengths, ...) is over this for patience intervals is quarantined at any format, the reason naming the share and the top validation reason (a higher precision does not repair an engine that answers garbage)."""

    @model_validator(mode="after")
    def _check_cooldown(self) -> PrecisionAutopilotSpec:
        if self.cooldown_intervals > self.max_cooldown_intervals:
            raise ValueError(
                f"{AUTOPILOT_COOLDOWN_MESSAGE} (got {self.cooldown_intervals} > {self.max_cooldown_intervals})"
            )
        return self


class RouterSpec(PodPlacement):
    """Router and rebalancer."""

    model_config = cel_rules(
        {"rule": STATIC_SHARES_RULE, "message": STATIC_SHARES_MESSAGE},
        {"rule": STATIC_SHARES_POSITIVE_RULE, "message": STATIC_SHARES_POSITIVE_MESSAGE},
        *POD_FIELDS_RULES,
    )

    policy: RouterPolicy = "throughput"
    """throughput (share proportional to tokens/s capacity, docs/router.md), cost (cheapest useful tokens) or static."""
    rebalance_interval_seconds: int = Field(default=30, ge=5, le=86400)
    """How often the operator recomputes shares."""
    max_share_change: float = Field(default=0.1, gt=0.0, le=1.0)
    """Largest change of any group's share per interval."""
    min_share: float = Field(default=0.02, ge=0.0, le=0.5)
    """Smallest share of a healthy, non-quarantined group."""
    smoothing: float = Field(default=0.5, gt=0.0, le=1.0)
    """EMA weight of the newest throughput sample."""
    demand_limited_intervals: int = Field(default=2, ge=1, le=100)
    """Rebalance intervals in a row at which no pod of a group has a request waiting (sglang:num_queue_reqs) before the throughput and cost policies weigh it by its catalog capacity estimate instead of what it delivered (1: a single reading; docs/router.md)."""
    static_shares: dict[str, Annotated[float, Field(ge=0.0, le=1000000.0)]] = Field(
        default_factory=dict, max_length=64
    )
    """policy static: share per group name (normalised)."""
    prometheus_url: str | None = Field(default=None, max_length=1024, pattern=HTTP_URL_PATTERN)
    """Read throughput from this Prometheus instead of scraping the sampler pods."""
    replicas: int = Field(default=1, ge=1, le=16)
    """Router replicas."""
    image: str = Field(default="ghcr.io/rlfleet/operator:0.1.0", min_length=1, max_length=512)
    """Router image (runs `rlfleet router serve`)."""
    admin_token_secret: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Secret (key `token`) with the router admin token (none: the operator creates one)."""
    reference: ReferenceFleetSpec = Field(
        default_factory=ReferenceFleetSpec, json_schema_extra={"default": {}}
    )
    """The reference fleet of status.savingPercent (default: trainer.accelerator in BF16, as the job's groups of that class measure it, else as the catalog's throughput ratios estimate it from the other groups)."""
    optimize: FleetOptimizeSpec = Field(default_factory=FleetOptimizeSpec, json_schema_extra={"default": {}})
    """The fleet-mix optimizer: replicas and shares per group from measured throughput, cost and mismatch (off by default)."""
    autopilot: PrecisionAutopilotSpec = Field(
        default_factory=PrecisionAutopilotSpec, json_schema_extra={"default": {}}
    )
    """The precision autopilot: a group over its own mismatch budget moves up a precision step or is quarantined (off by default)."""

    @model_validator(mode="after")
    def _check_static(self) -> RouterSpec:
        if self.policy == "static" and not self.static_shares:
            raise ValueError(STATIC_SHARES_MESSAGE)
        if self.static_shares and not any(v > 0 for v in self.static_shares.values()):
            raise ValueError(STATIC_SHARES_POSITIVE_MESSAGE)
        return self
