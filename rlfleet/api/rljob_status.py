"""RLJob status: what the operator observed and decided of a job (its one status writer writes it whole,
operator/job_status.py), and the policies' memory a restarted operator reads back (operator/decide.py).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from rlfleet.api.common import ApiModel, Condition, conditions_field
from rlfleet.api.samplergroup import PrecisionCooldown, ShareChange, SteadyThroughput


class TrainerStatus(ApiModel):
    """Observed trainer."""

    replicas: int | None = Field(default=None, ge=0)
    """Desired trainer pods."""
    ready_replicas: int | None = Field(default=None, ge=0)
    """Ready trainer pods."""
    ready: str | None = Field(default=None, max_length=32)
    """Ready over desired trainer pods, e.g. "1/1" (printer column)."""


class GroupSummary(ApiModel):
    """One line per sampler group in the RLJob status."""

    name: str = Field(max_length=63)
    """Group name."""
    phase: str | None = Field(default=None, max_length=32)
    """SamplerGroup phase."""
    ready: str | None = Field(default=None, max_length=32)
    """Ready/desired replicas."""
    share: float | None = Field(default=None, ge=0.0, le=1.0)
    """Routing share."""


class RunMetrics(ApiModel):
    """Latest training metrics (reported by the trainer)."""

    reward: float | None = None
    """Mean reward of the last batch."""
    kl: float | None = None
    """Mean sampler/trainer KL (kl_k3)."""
    oor_fraction: float | None = Field(default=None, ge=0.0, le=1.0)
    """Share of tokens outside the MIS band."""
    entropy: float | None = None
    """Mean token entropy."""
    sc_tail_ratio: float | None = None
    """Score-centering tail ratio rho."""
    updated_at: datetime | None = None
    """When these metrics were reported."""


class FleetThroughputStatus(ApiModel):
    """The tokens/s per replica the optimizer planned a group at, and from what."""

    tokens_per_second_per_replica: float = Field(ge=0.0)
    """Decode tokens/s of one replica."""
    basis: Literal["measured", "lowerBound", "estimated"]
    """measured: the group's last steady reading at saturation, or a higher one since (status.decisions.groups[].memory.steadyThroughput); lowerBound: read only while demand-limited (its queues empty), so the group keeps its replicas; estimated: none yet, carried from the saturated groups by the catalog's decodeThroughput ratios."""
    detail: str = Field(default="", max_length=256)
    """The reading (replicas, format, when) or the groups the estimate comes from."""


class FleetPlanStatus(ApiModel):
    """What the fleet-mix optimizer decided at its last rebalance interval, and why."""

    decision: Literal["Scaled", "Kept", "Stepping", "Infeasible", "Waiting"]
    """Scaled: replicas changed to the plan; Kept: the plan keeps the current replicas (hysteresis, or they are the optimum); Stepping: no plan within one step meets the demand, groups below the unstepped optimum go up one step; Infeasible: no plan meets the budgets, nothing changed; Waiting: no plan yet (no throughput reading), nothing changed."""
    reason: str = Field(max_length=2048)
    """Why (the solver's verdict, the groups left out and why, the constraint no plan meets)."""
    replicas: dict[str, int] = Field(default_factory=dict, max_length=32)
    """Replicas per group after this decision."""
    binding: list[Annotated[str, Field(max_length=512)]] = Field(default_factory=list, max_length=64)
    """The constraints whose removal alone would make the plan cheaper, each with what it costs."""
    throughput: dict[str, FleetThroughputStatus] = Field(default_factory=dict, max_length=32)
    """The tokens/s per replica each planned group was planned at (measured or estimated)."""
    cost_per_hour: float | None = Field(default=None, ge=0.0)
    """USD per hour of the plan's replicas."""
    cost_per_1m_usable_tokens: float | None = Field(default=None, ge=0.0, alias="costPer1MUsableTokens")
    """USD per million usable tokens of the plan, its replicas busy."""


class GroupPolicyMemory(ApiModel):
    """What the policies remember of a group from one decision to the next."""

    counters: dict[str, float] = Field(default_factory=dict, max_length=256)
    """The share policy: each ready pod's sglang:realtime_tokens_total{mode="decode"} at the decision (the next rate starts from it)."""
    tokens_per_second: float | None = Field(default=None, ge=0.0)
    """The share policy: the group's smoothed decode tokens/s."""
    recorded_share: float | None = Field(default=None, ge=0.0, le=1.0)
    """The share policy: the share of the group's last history entry."""
    share_history: list[ShareChange] = Field(default_factory=list, max_length=5)
    """The share policy: the group's last (at most 5) share changes, newest last."""
    empty_queue_intervals: int | None = Field(default=None, ge=0)
    """The share policy: decisions in a row at which no pod of the group had a request waiting (router.demandLimitedIntervals of them: weighed by its capacity estimate)."""
    steady_throughput: SteadyThroughput | None = None
    """The fleet-mix optimizer: the group's last steady tokens/s per replica (it plans a group at 0 replicas from it)."""
    ready_replicas: int | None = Field(default=None, ge=0)
    """The fleet-mix optimizer: the group's ready replicas at the decision."""
    ready_unchanged: int | None = Field(default=None, ge=0)
    """The fleet-mix optimizer: for how many decisions before they had not changed."""
    over_budget: int | None = Field(default=None, ge=0)
    """The precision autopilot: decisions in a row the group was over its budget."""
    settling: int | None = Field(default=None, ge=0)
    """The precision autopilot: decisions still to wait after a change before the group is judged again."""
    within_budget: int | None = Field(default=None, ge=0)
    """The precision autopilot: judged decisions in a row within its budget (its cool-down counts them)."""
    precision_cooldown: PrecisionCooldown | None = None
    """The precision autopilot: the group's doubled cool-down and probation after a step down (absent: neither)."""


class GroupDecisionStatus(ApiModel):
    """One group's decision, with the reason of each field."""

    name: str = Field(max_length=63)
    """Group name."""
    replicas: int = Field(ge=0, le=1024)
    """Replicas, set through the SamplerGroup's scale subresource: the RLJob's when it changed since the last decision, the fleet-mix optimizer's, else the SamplerGroup's own (what the RLJob created it with, or a kubectl scale since: the reason says so)."""
    replicas_reason: str = Field(default="", max_length=1024)
    """Why."""
    weight_format: str = Field(max_length=16)
    """The weight format its SamplerGroup is built with: the RLJob's, or the precision autopilot's step."""
    weight_format_reason: str = Field(default="", max_length=1024)
    """Why."""
    share: float = Field(ge=0.0, le=1.0)
    """Routing share of new sessions pushed to the routers."""
    share_reason: str = Field(default="", max_length=1024)
    """Why."""
    quarantined: bool = False
    """True: share 0, no new sessions."""
    quarantine_reason: str = Field(default="", max_length=1024)
    """By what (spec.quarantined, the annotation rlfleet.dev/quarantined, the trainer's collapse detector, the precision autopilot); empty when not quarantined."""
    job_weight_format: str = Field(max_length=16)
    """The RLJob's weightFormat of the group when this was decided: a new one ends the autopilot's step and quarantine."""
    held_quarantine: str | None = Field(default=None, max_length=1024)
    """The precision autopilot's quarantine, held until the RLJob's weightFormat of the group changes or the SamplerGroup is annotated rlfleet.dev/quarantined=false."""
    job_replicas: int | None = Field(default=None, ge=0, le=1024)
    """The RLJob's replicas of the group when this was decided: a new value wins over the SamplerGroup's own."""
    memory: GroupPolicyMemory = Field(default_factory=GroupPolicyMemory)
    """What the policies remember of the group for the next decision."""


class ViewTrafficMemory(ApiModel):
    """The trainer's stored bytes of one view at the last reading, and their smoothed rate."""

    counter: float | None = Field(default=None, ge=0.0)
    """rlfleet_trainer_weights_stored_bytes_total{view} when read."""
    time: float | None = None
    """When read, epoch seconds."""
    ema_bytes_per_second: float | None = Field(default=None, ge=0.0)
    """Smoothed bytes/s stored for the view (prices a group's weight traffic)."""


class DecisionsStatus(ApiModel):
    """The operator's decisions of the job at its last rebalance interval (operator/decide.py): per group its replicas, weight format, share and quarantine with the reason of each, and what the policies remember; a restarted operator goes on from them."""

    time: float
    """When decided, epoch seconds (the next decision is due router.rebalanceIntervalSeconds later)."""
    groups: list[GroupDecisionStatus] = Field(default_factory=list, max_length=32)
    """One decision per SamplerGroup of the job."""
    views: dict[str, ViewTrafficMemory] = Field(default_factory=dict, max_length=16)
    """The share policy's reading of the trainer's stored bytes per view."""


class RLJobStatus(ApiModel):
    """Observed state of an RLJob."""

    phase: Literal["Pending", "Running", "Degraded", "Suspended", "Failed", "Succeeded"] | None = None
    """Pending, Running, Degraded, Suspended, Failed or Succeeded."""
    observed_generation: int | None = Field(default=None, ge=0)
    """metadata.generation the status was computed from."""
    reason: str | None = Field(default=None, max_length=128)
    """Machine-readable reason of the phase."""
    message: str | None = Field(default=None, max_length=4096)
    """Human-readable summary."""
    ready_groups: str | None = Field(default=None, max_length=32)
    """Ready sampler groups over all groups, e.g. "8/8"."""
    groups: list[GroupSummary] = Field(default_factory=list, max_length=32)
    """Per-group summary."""
    trainer: TrainerStatus | None = None
    """Trainer pods."""
    step: int | None = Field(default=None, ge=0)
    """Last optimizer step (reported by the trainer)."""
    weight_version: int | None = Field(default=None, ge=0)
    """Latest published weight version."""
    external_version: int | None = Field(default=None, ge=0)
    """An external trainer's newest version (trainer.external: slime's newest weight_v<N> directory, written or being written; weightVersion is the newest the channel serves, each SamplerGroup's the one it serves)."""
    metrics: RunMetrics | None = None
    """Latest training metrics."""
    cost_per_1m_tokens: float | None = Field(default=None, ge=0.0, alias="costPer1MTokens")
    """USD per million usable tokens (inside the MIS band) of the whole sampler fleet: its USD per hour over its usable tokens per hour."""
    baseline_cost_per_1m_tokens: float | None = Field(default=None, ge=0.0, alias="baselineCostPer1MTokens")
    """The same for the reference fleet: every token made in BF16 on the class router.reference names (default trainer.accelerator)."""
    saving_percent: float | None = None
    """100 x (1 - costPer1MTokens / baselineCostPer1MTokens): what the mixed fleet saves per usable token against the reference fleet (negative: it costs more)."""
    baseline_source: str | None = Field(default=None, max_length=256)
    """Where the reference fleet's tokens/s per GPU come from: router.reference.tokensPerGpuSecond ("given"), the job's BF16 groups of the class ("measured"), or the other groups through the catalog's decodeThroughput ratios ("estimated from catalog throughput ratios")."""
    fleet_plan: FleetPlanStatus | None = None
    """The fleet-mix optimizer's last decision (router.optimize)."""
    precision_autopilot: dict[str, Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=32
    )
    """The precision autopilot's last change per group and why (router.autopilot)."""
    decisions: DecisionsStatus | None = None
    """The operator's decisions of the job (operator/decide.py)."""
    conditions: list[Condition] = conditions_field()
    """Ready, Progressing, Degraded and CollapseRisk conditions."""
