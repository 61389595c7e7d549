"""The decide stage of an RLJob (issue 41). PURE: no I/O, no clock, no Kubernetes.

    observe (rebalancer.py: each group's pods and metrics, the trainer's report) -> decide (here) ->
    RLJob status.decisions (the one status writer) -> each SamplerGroup derived from spec + decisions
    (builders.py, the one apply) -> the routers told the decisions' shares and quarantines, the
    decided replicas through each SamplerGroup's /scale

`decide(job, observations, previous, now)` gives, per group, its replicas, weight format, share and
quarantine, each with the reason, and what the policies remember (the share policy's counters, EMA and
history; the fleet-mix optimizer's steady figures; the precision autopilot's counts, cool-downs and
probations). It composes the policies: rebalance.py (shares), autopilot.py (weight format and its
quarantine), fleetplan.py (replicas and its shares). `Decisions.status()` is the RLJob's
`status.decisions`; `Decisions.from_status` reads it back, so a restarted operator goes on from what it
decided, and nothing is restored from anywhere else.

Per group:
- weightFormat: the RLJob's `samplerGroups[].weightFormat`, or the autopilot's last step while the RLJob's
  value is still the one the decision was made under (`jobWeightFormat`): a new value in the RLJob ends
  the override.
- quarantine, the first source that holds: the RLJob's `quarantined`, the SamplerGroup's annotation
  `rlfleet.dev/quarantined: "true"` (on call), the trainer's collapse detector
  (`safety.action: quarantine-group`), the autopilot's quarantine. The autopilot's is held until the
  RLJob's weightFormat of the group changes, or the annotation says "false" (an on-call human takes the
  group back: released, and not quarantined by the autopilot while the annotation stays).
- share: the share policy's (rebalance.py), or the fleet-mix optimizer's plan (`router.optimize`).
- replicas: the RLJob's `samplerGroups[].replicas` when it changed since the last decision (`jobReplicas`:
  the value that decision was made under), else the optimizer's plan, else the SamplerGroup's own: what
  the RLJob created it with, the last decision's, or a `kubectl scale` since (an observation: its reason
  says so, and it stays until the RLJob's value changes). Carried out through each SamplerGroup's /scale
  (replicas.py: after its creation, the builders do not write them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from rlfleet.api import RLJob, SamplerGroupTemplate
from rlfleet.api.common import views_to_publish
from rlfleet.catalog import Catalog, CatalogError, get_catalog
from rlfleet.operator import autopilot, fleetplan, group_status
from rlfleet.operator import status as st
from rlfleet.operator.builders import build_samplergroup
from rlfleet.operator.rebalance import (
    GroupInput,
    GroupMemory,
    PodSample,
    RebalanceConfig,
    RebalanceResult,
    RebalanceState,
    ViewMemory,
    queues_empty,
    rebalance,
    replica_egress_cost_per_hour,
)
from rlfleet.records import INVALID_METRIC_PREFIX

RLJOB_FORMAT = "the RLJob's samplerGroups[].weightFormat"
SG_REPLICAS = (
    "the SamplerGroup's spec.replicas (the RLJob's samplerGroups[].replicas, or the last decision's)"
)
SCALED_BY_HAND = "scaled on the SamplerGroup (kubectl scale)"
RELEASED = f"annotation {group_status.ANN_QUARANTINED}=false"
REASON_LIMIT = 1024  # each reason in status.decisions


# --- what the tick observes -------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupObservation:
    """One SamplerGroup of the job at one decision, as the tick read it."""

    name: str  # the group's name in the RLJob
    replicas: int  # its spec.replicas now (the RLJob's, a kubectl scale, or the optimizer's last /scale)
    ready_replicas: int
    pods: Mapping[str, PodSample] = field(default_factory=dict)  # ready pod -> its SGLang /metrics
    tokens_per_second: float | None = None  # read from spec.router.prometheusUrl instead of the pods
    trainer: Mapping[str, float] = field(default_factory=dict)  # the trainer's metrics of the group's tokens
    annotation: str | None = None  # the SamplerGroup's rlfleet.dev/quarantined annotation (on call)


@dataclass(frozen=True)
class Observations:
    """What one decision reads: the job's SamplerGroups and the trainer's report."""

    groups: tuple[GroupObservation, ...]
    collapse_quarantine: frozenset[str] = frozenset()  # groups the trainer's collapse detector names
    trainer_fleet: Mapping[str, float] = field(default_factory=dict)  # its fleet metrics (a derived demand)
    weights_stored_bytes: Mapping[str, float] | None = None  # per view (None: not read this interval)


# --- what it decides ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupDecision:
    """One group's decision, a reason for each field."""

    name: str
    replicas: int
    replicas_reason: str
    weight_format: str
    weight_format_reason: str
    share: float
    share_reason: str
    quarantined: bool
    quarantine_reason: str  # "" when not quarantined
    job_weight_format: str  # the RLJob's weightFormat this decision was made under (a new one resets it)
    held_quarantine: str | None = None  # the autopilot's quarantine, held until released (module docstring)
    job_replicas: int | None = None  # the RLJob's replicas this decision was made under (None: not recorded)


@dataclass(frozen=True)
class Decisions:
    """One decision of a job: per group, and what the policies remember for the next one. `result`,
    `plan` and `actions` are what this decision computed on the way (figures for the SamplerGroups'
    status, the optimizer's status, Events); they are not kept in status nor compared."""

    time: float  # epoch seconds: the next decision is due an interval later
    groups: Mapping[str, GroupDecision]
    state: RebalanceState = field(default_factory=RebalanceState)
    fleet: fleetplan.FleetMemory = field(default_factory=fleetplan.FleetMemory)
    precision: autopilot.AutopilotMemory = field(default_factory=autopilot.AutopilotMemory)
    precision_changes: Mapping[str, str] = field(default_factory=dict)  # group -> the autopilot's last change
    result: RebalanceResult | None = field(default=None, compare=False)
    plan: fleetplan.FleetDecision | None = field(default=None, compare=False)
    actions: tuple[autopilot.AutopilotAction, ...] = field(default=(), compare=False)

    @property
    def shares(self) -> dict[str, float]:
        return {g: d.share for g, d in self.groups.items()}

    @property
    def quarantined(self) -> dict[str, bool]:
        return {g: d.quarantined for g, d in self.groups.items()}

    def weight_formats(self, job: RLJob) -> dict[str, str]:
        """The weightFormat to build each group's SamplerGroup with: the decided one while the RLJob's own
        value is the one it was decided under (a group not decided yet, or changed in the RLJob since:
        none, the RLJob's)."""
        own = {g.name: g.weight_format for g in job.spec.sampler_groups}
        return {g: d.weight_format for g, d in self.groups.items() if own.get(g) == d.job_weight_format}

    def status(self) -> dict[str, Any]:
        """RLJob `status.decisions` (camelCase; floats unrounded, so that a restart goes on exactly)."""
        return {
            "time": self.time,
            "groups": [_group_status(d, self) for d in self.groups.values()],
            "views": {
                view: st.present(
                    {"counter": m.counter, "time": m.time, "emaBytesPerSecond": m.ema_bytes_per_second}
                )
                for view, m in self.state.views.items()
            },
        }

    @classmethod
    def from_status(cls, status: Mapping[str, Any] | None) -> Decisions | None:
        """The decisions in an RLJob's status (`status.decisions`, with `status.precisionAutopilot`); None
        when it has none (a job not decided yet)."""
        data = (status or {}).get("decisions")
        if not data:
            return None
        time = float(data["time"])
        groups: dict[str, GroupDecision] = {}
        state, fleet, precision = RebalanceState(), fleetplan.FleetMemory(), autopilot.AutopilotMemory()
        for g in data.get("groups") or []:
            name = g["name"]
            groups[name] = GroupDecision(
                name=name,
                replicas=int(g["replicas"]),
                replicas_reason=g.get("replicasReason", ""),
                weight_format=g["weightFormat"],
                weight_format_reason=g.get("weightFormatReason", ""),
                share=float(g["share"]),
                share_reason=g.get("shareReason", ""),
                quarantined=bool(g["quarantined"]),
                quarantine_reason=g.get("quarantineReason", ""),
                job_weight_format=g["jobWeightFormat"],
                held_quarantine=g.get("heldQuarantine"),
                job_replicas=g.get("jobReplicas"),
            )
            _read_memory(name, g.get("memory") or {}, time, float(g["share"]), state, fleet, precision)
        for view, m in (data.get("views") or {}).items():
            state.views[view] = ViewMemory(
                counter=m.get("counter"), time=m.get("time"), ema_bytes_per_second=m.get("emaBytesPerSecond")
            )
        changes = dict((status or {}).get("precisionAutopilot") or {})
        return cls(time, groups, state, fleet, precision, changes)


def _group_status(d: GroupDecision, decisions: Decisions) -> dict[str, Any]:
    """One group of `status.decisions`: the decision and its policies' memory."""
    out: dict[str, Any] = {
        "name": d.name,
        "replicas": d.replicas,
        "replicasReason": d.replicas_reason,
        "weightFormat": d.weight_format,
        "weightFormatReason": d.weight_format_reason,
        "share": d.share,
        "shareReason": d.share_reason,
        "quarantined": d.quarantined,
        "quarantineReason": d.quarantine_reason,
        "jobWeightFormat": d.job_weight_format,
    }
    if d.held_quarantine is not None:
        out["heldQuarantine"] = d.held_quarantine
    if d.job_replicas is not None:
        out["jobReplicas"] = d.job_replicas
    memory: dict[str, Any] = {}
    rebalanced = decisions.state.groups.get(d.name)
    if rebalanced is not None:
        memory.update(
            counters=dict(rebalanced.counters),
            tokensPerSecond=rebalanced.ema_tokens_per_second,
            recordedShare=rebalanced.recorded_share,
            shareHistory=[dict(h) for h in rebalanced.history],
            emptyQueueIntervals=rebalanced.empty_queue_intervals,
        )
    steady = decisions.fleet.steady.get(d.name)
    if steady is not None:
        memory["steadyThroughput"] = st.present(
            {
                "tokensPerSecondPerReplica": steady.tokens_per_second_per_replica,
                "replicas": steady.replicas,
                "weightFormat": steady.weight_format,
                "measuredAt": steady.measured_at,
                "saturated": steady.saturated,
            }
        )
    if d.name in decisions.fleet.ready:
        memory["readyReplicas"], memory["readyUnchanged"] = decisions.fleet.ready[d.name]
    precision = decisions.precision
    memory.update(
        overBudget=precision.over.get(d.name),
        settling=precision.settling.get(d.name),
        withinBudget=precision.within.get(d.name),
        precisionCooldown=autopilot.cooldown_status(precision, d.name),
    )
    out["memory"] = st.present(memory)
    return out


def _read_memory(
    name: str,
    m: Mapping[str, Any],
    time: float,
    share: float,
    state: RebalanceState,
    fleet: fleetplan.FleetMemory,
    precision: autopilot.AutopilotMemory,
) -> None:
    """One group's policy memory from `status.decisions` into the three policies' memories."""
    if "counters" in m:
        state.groups[name] = GroupMemory(
            counters={k: float(v) for k, v in m["counters"].items()},
            time=time,
            ema_tokens_per_second=m.get("tokensPerSecond"),
            share=share,
            recorded_share=m.get("recordedShare"),
            history=[dict(h) for h in m.get("shareHistory") or []],
            empty_queue_intervals=int(m.get("emptyQueueIntervals") or 0),  # absent: written before it existed
        )
    if (steady := m.get("steadyThroughput")) is not None:
        fleet.steady[name] = fleetplan.SteadyFigure(
            float(steady["tokensPerSecondPerReplica"]),
            int(steady["replicas"]),
            steady["weightFormat"],
            steady.get("measuredAt"),
            bool(steady.get("saturated", True)),  # absent: written before lower bounds were told apart
        )
    if "readyReplicas" in m:
        fleet.ready[name] = (int(m["readyReplicas"]), int(m.get("readyUnchanged", 0)))
    for key, counts in (
        ("overBudget", precision.over),
        ("settling", precision.settling),
        ("withinBudget", precision.within),
    ):
        if m.get(key) is not None:
            counts[name] = int(m[key])
    cooldown = m.get("precisionCooldown") or {}
    if cooldown.get("cooldownIntervals"):
        precision.cooldown[name] = int(cooldown["cooldownIntervals"])
    if cooldown.get("onProbation"):
        precision.probation.add(name)


# --- the policies' inputs ---------------------------------------------------------------------------


def job_config(job: RLJob, catalog: Catalog) -> RebalanceConfig:
    """The share policy's configuration of a job (its reference fleet priced from the catalog)."""
    r = job.spec.router
    reference = r.reference
    accelerator = reference.accelerator or job.spec.trainer.accelerator
    price: float | None = reference.cost_per_gpu_hour
    if price is None:
        try:
            price = catalog.get(accelerator).cost_per_gpu_hour
        except (CatalogError, KeyError):
            price = None
    return RebalanceConfig(
        policy=r.policy,
        max_share_change=r.max_share_change,
        min_share=r.min_share,
        smoothing=r.smoothing,
        demand_limited_intervals=r.demand_limited_intervals,
        reference_accelerator=accelerator,
        reference_price_per_gpu_hour=price,
        reference_tokens_per_gpu_second=reference.tokens_per_gpu_second,
        reference_oor_fraction=reference.oor_fraction,
        catalog=catalog,
    )


def rate_window(interval_seconds: int) -> int:
    """Seconds of the Prometheus rate a group's throughput is read over (`spec.router.prometheusUrl`)."""
    return max(2 * interval_seconds, 60)


def invalid_tokens(trainer: Mapping[str, float]) -> dict[str, float]:
    """A group's invalid tokens by validation reason from its trainer metrics (`invalid_reason_<reason>`,
    trainer/metrics.py `invalid_token_metrics`), the counts > 0."""
    return {
        k[len(INVALID_METRIC_PREFIX) :]: v
        for k, v in trainer.items()
        if k.startswith(INVALID_METRIC_PREFIX) and v > 0
    }


def group_input(
    job: RLJob,
    sg: Mapping[str, Any],
    pods: Mapping[str, PodSample],
    trainer: Mapping[str, float],
    tokens_per_second: float | None,
    collapse_quarantine: frozenset[str] = frozenset(),
    catalog: Catalog | None = None,
    held: str | None = None,
) -> GroupInput:
    """The share policy's input of one SamplerGroup (`sg`: as `child` derives it) with this interval's
    readings; `held`: the precision autopilot's held quarantine of the group."""
    spec = sg.get("spec") or {}
    status = sg.get("status") or {}
    accelerator = spec.get("accelerator", "")
    try:
        cls = (catalog or get_catalog()).get(accelerator)
        price, default_tp = cls.cost_per_gpu_hour, cls.default_tensor_parallel
    except (CatalogError, KeyError):
        price, default_tp = 0.0, 1
    tp = spec.get("tensorParallel") or default_tp
    name = spec.get("name", "")
    return GroupInput(
        name=name,
        ready_replicas=int(status.get("readyReplicas") or 0),
        gpus=int(spec.get("replicas", 1)) * int(tp),
        price_per_gpu_hour=float(price),
        pods=dict(pods),
        accelerator=accelerator,
        weight_format=spec.get("weightFormat", "bf16"),
        kl=trainer.get("kl_k3"),
        oor_fraction=trainer.get("oor_fraction"),
        token_share=trainer.get("token_share"),
        oor_share=trainer.get("oor_share"),
        routing_mismatch=trainer.get("routing_mismatch_tokens"),
        trained_fraction=trainer.get("trained_fraction"),
        invalid_tokens=invalid_tokens(trainer),
        quarantined=group_status.quarantine_reason(dict(sg), collapse_quarantine, held) is not None,
        static_share=job.spec.router.static_shares.get(name),
        tokens_per_second=tokens_per_second,
        egress_price_per_gb=spec.get("egressPricePerGb"),
        lora=bool(spec.get("lora")),
        tensor_parallel=int(tp),
    )


def child(
    job: RLJob, group: SamplerGroupTemplate, observed: GroupObservation, weight_format: str
) -> dict[str, Any]:
    """The SamplerGroup the builder derives from the RLJob and the decided weight format, at its observed
    replicas, ready replicas and annotation: the group as the policies judge it."""
    sg = build_samplergroup(job, group, "", None, weight_format, observed.replicas)
    if observed.annotation is not None:
        sg["metadata"]["annotations"] = {group_status.ANN_QUARANTINED: observed.annotation}
    sg["status"] = {"readyReplicas": observed.ready_replicas}
    return sg


# --- the decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Carried:
    """What a group carries into this decision from the previous one."""

    weight_format: str
    weight_format_reason: str
    held: str | None  # the autopilot's held quarantine


def _carry(group: SamplerGroupTemplate, previous: GroupDecision | None, annotation: str | None) -> _Carried:
    """The previous decision's weight format and held quarantine, while the RLJob's weightFormat is the one
    it was made under (and, for the quarantine, no on-call "false")."""
    if previous is None or previous.job_weight_format != group.weight_format:
        return _Carried(group.weight_format, RLJOB_FORMAT, None)
    held = previous.held_quarantine if annotation != "false" else None
    return _Carried(previous.weight_format, previous.weight_format_reason, held)


def decide(
    job: RLJob, observations: Observations, previous: Decisions | None, now: float, catalog: Catalog
) -> Decisions:
    """This interval's decisions of `job` from `observations` and the `previous` decisions (None: the job's
    first). Module docstring: the rules."""
    templates = {g.name: g for g in job.spec.sampler_groups}
    observed = [o for o in observations.groups if o.name in templates]
    before = previous.groups if previous is not None else {}
    carried = {o.name: _carry(templates[o.name], before.get(o.name), o.annotation) for o in observed}
    children = {o.name: child(job, templates[o.name], o, carried[o.name].weight_format) for o in observed}
    inputs = [
        group_input(
            job,
            children[o.name],
            o.pods,
            o.trainer,
            o.tokens_per_second,
            observations.collapse_quarantine,
            catalog,
            carried[o.name].held,
        )
        for o in observed
    ]
    memory = previous.precision if previous is not None else autopilot.AutopilotMemory()
    actions: list[autopilot.AutopilotAction] = []
    if job.spec.router.autopilot.enabled:
        actions, memory = _autopilot(job, inputs, children, memory, catalog)
        stepped = {a.group: a for a in actions}
        inputs = [
            replace(g, quarantined=True) if g.name in stepped and stepped[g.name].kind == "quarantine" else g
            for g in inputs
        ]
    config = job_config(job, catalog)
    state = previous.state if previous is not None else None
    result = rebalance(inputs, state, now, config, weights_stored_bytes=observations.weights_stored_bytes)
    fleet = previous.fleet if previous is not None else fleetplan.FleetMemory()
    plan: fleetplan.FleetDecision | None = None
    if job.spec.router.optimize.enabled:
        plan, fleet = _fleet_plan(
            job, observed, children, inputs, result, fleet, memory, observations, config, now
        )
        if plan.shares is not None:  # the plan's shares instead of the policy's, bounded alike
            planned = [replace(g, static_share=plan.shares.get(g.name, 0.0)) for g in inputs]
            result = rebalance(
                planned,
                state,
                now,
                replace(config, policy="plan", min_share=0.0),
                weights_stored_bytes=observations.weights_stored_bytes,
            )
    changes = dict(previous.precision_changes) if previous is not None else {}
    changes.update({a.group: st.clip(a.reason) for a in actions})
    groups = {
        o.name: _group_decision(
            templates[o.name],
            o,
            carried[o.name],
            before.get(o.name),
            result,
            plan,
            actions,
            observations.collapse_quarantine,
        )
        for o in observed
    }
    return Decisions(now, groups, result.state, fleet, memory, changes, result, plan, tuple(actions))


def _group_decision(
    group: SamplerGroupTemplate,
    o: GroupObservation,
    carried: _Carried,
    previous: GroupDecision | None,
    result: RebalanceResult,
    plan: fleetplan.FleetDecision | None,
    actions: Sequence[autopilot.AutopilotAction],
    collapse: frozenset[str],
) -> GroupDecision:
    """One group's decision from the policies' outcomes."""
    weight_format, format_reason, held = carried.weight_format, carried.weight_format_reason, carried.held
    for action in (a for a in actions if a.group == o.name):
        if action.to_format is not None:
            weight_format, format_reason = action.to_format, action.reason
        else:
            held = action.reason
    replicas, replicas_reason = _replicas(group, o, previous, plan)
    quarantine = group_status.quarantine_source(group.quarantined, o.annotation, o.name in collapse, held)
    return GroupDecision(
        name=o.name,
        replicas=replicas,
        replicas_reason=st.clip(replicas_reason, REASON_LIMIT),
        weight_format=weight_format,
        weight_format_reason=st.clip(format_reason, REASON_LIMIT),
        share=result.shares[o.name],
        share_reason=st.clip(result.groups[o.name].reason, REASON_LIMIT),
        quarantined=quarantine is not None,
        quarantine_reason=st.clip(quarantine or "", REASON_LIMIT),
        job_weight_format=group.weight_format,
        held_quarantine=held and st.clip(held, REASON_LIMIT),
        job_replicas=group.replicas,
    )


def _replicas(
    group: SamplerGroupTemplate,
    o: GroupObservation,
    previous: GroupDecision | None,
    plan: fleetplan.FleetDecision | None,
) -> tuple[int, str]:
    """A group's replicas and why (module docstring): the RLJob's change, the plan's, else the observed."""
    if previous is not None and previous.job_replicas is not None and previous.job_replicas != group.replicas:
        return group.replicas, rljob_replicas_reason(previous.job_replicas, group.replicas)
    if plan is not None and o.name in plan.changes():
        return plan.replicas[o.name], f"fleet plan ({plan.decision}): {plan.reason}"
    expected, whose = (
        (previous.replicas, "the last decision's")
        if previous is not None
        else (group.replicas, "the RLJob's")
    )
    if o.replicas != expected:
        return o.replicas, (
            f"{SCALED_BY_HAND} to {o.replicas}, not {whose} {expected}: kept until the RLJob's "
            "samplerGroups[].replicas changes"
        )
    if previous is not None and previous.replicas_reason.startswith(SCALED_BY_HAND):
        return o.replicas, previous.replicas_reason  # still the hand's
    return o.replicas, SG_REPLICAS


def rljob_replicas_reason(before: int, after: int) -> str:
    return f"the RLJob's samplerGroups[].replicas changed: {before} -> {after}"


def replicas_changed_in_rljob(old_spec: Mapping[str, Any] | None, job: RLJob) -> dict[str, tuple[int, int]]:
    """Group name -> (before, after) for each group whose `replicas` the RLJob's spec changed from
    `old_spec` (the spec kopf last handled; None: nothing to compare, as at creation or resume). The
    reconcile scales them at once (the RLJob's change wins); the next decision says why."""
    if not old_spec:
        return {}
    before = {g.get("name"): int(g.get("replicas", 1)) for g in old_spec.get("samplerGroups") or []}
    return {
        g.name: (before[g.name], g.replicas)
        for g in job.spec.sampler_groups
        if g.name in before and before[g.name] != g.replicas
    }


def _autopilot(
    job: RLJob,
    inputs: Sequence[GroupInput],
    children: Mapping[str, Mapping[str, Any]],
    memory: autopilot.AutopilotMemory,
    catalog: Catalog,
) -> tuple[list[autopilot.AutopilotAction], autopilot.AutopilotMemory]:
    """The precision autopilot's interval (autopilot.py) over the groups as decided so far."""
    optimize, spec = job.spec.router.optimize, job.spec.router.autopilot
    floors = {
        group.name: group.weight_format for group in job.spec.sampler_groups
    }  # no step down below the RLJob's
    readings = []
    for g in inputs:
        max_kl, max_oor = autopilot.group_budgets(optimize, g.name)
        readings.append(
            autopilot.AutopilotReading(
                name=g.name,
                accelerator=g.accelerator,
                weight_format=g.weight_format,
                kv_cache_dtype=children[g.name]["spec"].get("kvCacheDtype", "auto"),
                kl=g.kl,
                oor_fraction=g.oor_fraction,
                max_kl=max_kl,
                max_oor_fraction=max_oor,
                quarantined=g.quarantined or _released(children[g.name]),
                floor_format=floors.get(g.name),
                trained_fraction=g.trained_fraction,
                invalid_tokens=g.invalid_tokens,
                max_invalid_fraction=spec.max_invalid_fraction,
            )
        )
    published = views_to_publish(group.weight_format for group in job.spec.sampler_groups)
    step_down = (
        autopilot.StepDown(spec.cooldown_intervals, spec.max_cooldown_intervals) if spec.step_down else None
    )
    return autopilot.autopilot(readings, memory, spec.patience, published, catalog, step_down)


def _released(sg: Mapping[str, Any]) -> bool:
    """An on-call human holds the group in rotation (annotation "false"): the autopilot does not judge it."""
    return ((sg.get("metadata") or {}).get("annotations") or {}).get(group_status.ANN_QUARANTINED) == "false"


def _fleet_plan(
    job: RLJob,
    observed: Sequence[GroupObservation],
    children: Mapping[str, Mapping[str, Any]],
    inputs: Sequence[GroupInput],
    result: RebalanceResult,
    fleet: fleetplan.FleetMemory,
    precision: autopilot.AutopilotMemory,
    observations: Observations,
    config: RebalanceConfig,
    now: float,
) -> tuple[fleetplan.FleetDecision, fleetplan.FleetMemory]:
    """The optimizer's decision of this interval from the share policy's readings (`result`: this
    interval's tokens/s per group, its views' stored bytes/s that price a group's weight traffic, the
    reference fleet's figures, the policy's shares), and its memory after it."""
    by_name = {g.name: g for g in inputs}
    catalog = config.catalog
    assert catalog is not None  # job_config's
    readings = []
    for o in observed:
        g = by_name[o.name]
        try:
            default_tp = catalog.get(g.accelerator).default_tensor_parallel
        except (CatalogError, KeyError):
            default_tp = 1
        egress = replica_egress_cost_per_hour(
            g.egress_price_per_gb, g.weight_format, result.state, lora=g.lora
        )
        readings.append(
            fleetplan.fleet_reading(
                children[o.name],
                g.price_per_gpu_hour,
                default_tp,
                result.groups[g.name].measured_tokens_per_second,
                g.kl,
                g.oor_fraction,
                g.quarantined,
                egress,
                queues_empty=queues_empty(g),
            )
        )
    router = job.spec.router
    # a Prometheus rate spans its window: a replica change shows in it for that long
    settle = (
        math.ceil(rate_window(router.rebalance_interval_seconds) / router.rebalance_interval_seconds)
        if router.prometheus_url
        else 1
    )
    fleet = fleetplan.observe(fleet, readings, settle, st.now_iso(datetime.fromtimestamp(now, tz=UTC)))
    figures = fleetplan.plan_figures(readings, fleet, catalog)
    economics = result.economics
    reference = fleetplan.ReferenceFigures(
        accelerator=config.reference_accelerator,
        tokens_per_gpu_second=economics.reference_tokens_per_gpu_second,
        cost_per_gpu_hour=config.reference_price_per_gpu_hour,
        oor_fraction=config.reference_oor_fraction,
    )
    held = {g: "precision autopilot: settling after a precision change" for g in precision.settling}
    trainer = observations.trainer_fleet
    request, left_out = fleetplan.fleet_request(
        router.optimize,
        job.spec.trainer.accelerator,
        reference,
        readings,
        {g: f.tokens_per_second_per_replica for g, f in figures.items()},
        held,
        trainer,
        lower_bounds={g for g, f in figures.items() if f.basis == "lowerBound"},
    )
    _, demand_source = fleetplan.demand_of(router.optimize, trainer)
    return fleetplan.decide(
        request, left_out, readings, result.shares, catalog, demand_source, figures
    ), fleet
