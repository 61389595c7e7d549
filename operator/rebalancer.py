"""The rebalancer: the I/O around the pure share policy (`rebalance.py`) for one RLJob: scrapes, the
policy, the router push. It writes no status and holds no timer.

Called on each tick of the job's pipelines (handlers.py: the WeightChannel timer, every
RLFLEET_REBALANCE_TICK seconds). At every tick it reads the trainer's report and per-group KL /
out-of-range metrics (rank 0's exporter: step, weight version, metrics, the collapse detector's state),
so that the status shows them from the first step; it acts when the job's
`spec.router.rebalanceIntervalSeconds` has elapsed. Per interval: read each SamplerGroup's live
throughput (its ready pods' SGLang /metrics, or `spec.router.prometheusUrl`), call the pure `rebalance.py`,
push quarantine and shares to every router pod's admin API, and post a Kubernetes Event per share change.
Replicas only with the fleet-mix optimizer on (`spec.router.optimize.enabled`, fleetplan.py): it
decides replicas and shares per group from the same readings, writes replicas through each SamplerGroup's
scale subresource (never the RLJob's spec; builders.py keeps the override until the RLJob's own replicas
change) with a FleetScaled Event, and its shares replace the share policy's. The router follows each
group's headless Service itself (router/membership.py), so a pod added or replaced between two ticks is
routed to as soon as it is ready. SamplerGroups and pods come from the
operator's kopf indexes (no listing per tick). The result and the trainer's report stay in memory
(`observed(...)`, dropped by `forget` when the RLJob is deleted): the pipeline computes the WHOLE status
of the groups and the job from them (status.py) and applies it once, under the operator's one status
field manager. State (counters, EMA, history) is seeded from the SamplerGroups' status when
a job is first seen (new, or after an operator restart), and the first step comes one interval later.

Quarantine has one path: `status.quarantine_reason` (spec, annotation, or the collapse detector with
`spec.safety.action: quarantine-group`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
from prometheus_client import Gauge

from rlfleet.api import RLJob
from rlfleet.api.common import views_to_publish
from rlfleet.catalog import CatalogError, get_catalog
from rlfleet.operator import autopilot, fleetplan, kube, parsed_jobs
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.pods import pod_ready
from rlfleet.operator.rebalance import (
    GroupInput,
    GroupMemory,
    PodSample,
    RebalanceConfig,
    RebalanceResult,
    RebalanceState,
    parse_sglang_metrics,
    parse_trainer_group_metrics,
    parse_trainer_stored_bytes,
    rebalance,
    replica_egress_cost_per_hour,
)
from rlfleet.operator.trainer_report import TrainerReport, parse_trainer_report, trainer_job_status
from rlfleet.records import INVALID_METRIC_PREFIX

log = logging.getLogger("rlfleet.operator.rebalance")

TICK_SECONDS = float(os.environ.get("RLFLEET_REBALANCE_TICK", "5"))
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=5, connect=2)


@dataclass
class JobMemory:
    """What the last rebalance tick of a job observed and decided (the pipeline's input)."""

    last_run: float | None = None
    state: RebalanceState | None = None
    token: str | None = None
    result: RebalanceResult | None = None  # None: not rebalanced since the operator started
    report: TrainerReport | None = None  # the trainer's last readable report
    # the trainer's stored bytes per view at this tick (rebalance.py `parse_trainer_stored_bytes`; None: unreadable)
    weights_stored_bytes: dict[str, float] | None = None
    fleet: fleetplan.FleetMemory = field(default_factory=fleetplan.FleetMemory)  # tokens/s per replica
    plan: fleetplan.FleetDecision | None = None  # the optimizer's last decision (router.optimize)
    precision: autopilot.AutopilotMemory = field(default_factory=autopilot.AutopilotMemory)  # the autopilot's
    precision_changes: dict[str, str] = field(default_factory=dict)  # group -> the autopilot's last change, why


_JOBS: dict[tuple[str, str, str], JobMemory] = {}

# Fleet economics per rebalance interval (exported by `rlfleet operator run --metrics-port`; the same
# figures as the status, unrounded; docs/economics.md, "Where the figures show").
_GROUP_LABELS = ("namespace", "rljob", "group")
_JOB_LABELS = ("namespace", "rljob")
GROUP_GAUGES = {
    "tokens_per_second": Gauge("rlfleet_operator_group_tokens_per_second", "Decode tokens/s of the group", _GROUP_LABELS),
    "cost_per_hour": Gauge("rlfleet_operator_group_cost_per_hour_usd", "USD per hour of the group's GPUs and weight traffic", _GROUP_LABELS),
    "usable_fraction": Gauge("rlfleet_operator_group_usable_token_fraction",
                             "Share of the group's tokens trained on and inside the MIS band", _GROUP_LABELS),
    "cost_per_1m_usable_tokens": Gauge("rlfleet_operator_group_cost_per_1m_usable_tokens_usd",
                                       "USD per 1M usable tokens of the group", _GROUP_LABELS),
}  # fmt: skip
JOB_GAUGES = {
    "tokens_per_second": Gauge("rlfleet_operator_job_tokens_per_second", "Decode tokens/s of the fleet", _JOB_LABELS),
    "cost_per_hour": Gauge("rlfleet_operator_job_cost_per_hour_usd", "USD per hour of the fleet's GPUs and weight traffic", _JOB_LABELS),
    "usable_fraction": Gauge("rlfleet_operator_job_usable_token_fraction",
                             "Share of the fleet's tokens trained on and inside the MIS band", _JOB_LABELS),
    "cost_per_1m_usable_tokens": Gauge("rlfleet_operator_job_cost_per_1m_usable_tokens_usd",
                                       "USD per 1M usable tokens of the fleet", _JOB_LABELS),
    "reference_cost_per_1m_usable_tokens": Gauge(
        "rlfleet_operator_job_reference_cost_per_1m_usable_tokens_usd",
        "USD per 1M usable tokens of the reference fleet (default: the trainer's class at bf16)", _JOB_LABELS),
    "saving": Gauge("rlfleet_operator_job_saving_ratio",
                    "1 - fleet / reference cost per usable token", _JOB_LABELS),
    "reference_estimated": Gauge(
        "rlfleet_operator_job_reference_estimated",
        "1: the reference fleet's throughput is estimated from the catalog's throughput ratios; 0: given or "
        "measured", _JOB_LABELS),
}  # fmt: skip
_EXPORTED_GROUPS: dict[tuple[str, str], set[str]] = {}  # (namespace, job) -> groups with gauges


def observed(job: Mapping[str, Any]) -> JobMemory:
    """The rebalance tick's memory of this RLJob (empty until its first tick)."""
    meta = job.get("metadata") or {}
    return _JOBS.get((meta.get("namespace", ""), meta.get("name", ""), str(meta.get("uid", ""))), JobMemory())


def forget(namespace: str, name: str) -> None:
    """Drop the memory of a deleted RLJob (of every uid it had under that name) and its gauges."""
    for key in [k for k in _JOBS if k[:2] == (namespace, name)]:
        del _JOBS[key]
    for group in _EXPORTED_GROUPS.pop((namespace, name), set()):
        for gauge in GROUP_GAUGES.values():
            _remove(gauge, namespace, name, group)
    for gauge in JOB_GAUGES.values():
        _remove(gauge, namespace, name)


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # never set (no figure yet)
        pass


def _set(gauge: Gauge, value: float | None, *labels: str) -> None:
    """Set the label set's value; an unknown figure (None) removes it, so no stale value stays exported."""
    if value is None:
        _remove(gauge, *labels)
    else:
        gauge.labels(*labels).set(value)


def export_economics(namespace: str, job_name: str, result: RebalanceResult) -> None:
    """Set the fleet-economics gauges of one rebalance result: per group and for the whole fleet,
    tokens/s, USD/h, the usable share of tokens and USD per 1M usable tokens; the reference's cost and
    the saving. Groups gone since the last result lose their label sets."""
    economics = result.economics
    for name, g in economics.groups.items():
        labels = (namespace, job_name, name)
        _set(GROUP_GAUGES["tokens_per_second"], g.tokens_per_second, *labels)
        _set(GROUP_GAUGES["cost_per_hour"], g.cost_per_hour, *labels)
        _set(GROUP_GAUGES["usable_fraction"], g.usable_fraction if g.tokens_per_second is not None else None, *labels)
        _set(GROUP_GAUGES["cost_per_1m_usable_tokens"], g.cost_per_1m_usable_tokens, *labels)
    names = set(economics.groups)
    for gone in _EXPORTED_GROUPS.get((namespace, job_name), set()) - names:
        for gauge in GROUP_GAUGES.values():
            _remove(gauge, namespace, job_name, gone)
    _EXPORTED_GROUPS[(namespace, job_name)] = names
    job = {
        "tokens_per_second": economics.tokens_per_second,
        "cost_per_hour": economics.cost_per_hour,
        "usable_fraction": economics.usable_fraction,
        "cost_per_1m_usable_tokens": economics.cost_per_1m_usable_tokens,
        "reference_cost_per_1m_usable_tokens": economics.reference_cost_per_1m_usable_tokens,
        "saving": economics.saving,
        "reference_estimated": None if economics.reference_basis is None else float(economics.reference_basis == "estimated"),
    }
    for key, value in job.items():
        _set(JOB_GAUGES[key], value, namespace, job_name)


def fleet_costs(result: RebalanceResult) -> dict[str, float | str]:
    """The RLJob's fleet and reference cost per 1M usable tokens, the saving in percent and where the
    reference's throughput came from (`baselineSource`) of a rebalance result (None dropped)."""
    saving = result.saving
    costs = {  # (value, digits)
        "costPer1MTokens": (result.fleet_cost_per_1m_usable_tokens, 4),
        "baselineCostPer1MTokens": (result.baseline_cost_per_1m_usable_tokens, 4),
        "savingPercent": (None if saving is None else 100.0 * saving, 2),
    }
    figures: dict[str, float | str] = {k: round(v, digits) for k, (v, digits) in costs.items() if v is not None}
    source = result.economics.reference_source
    if source is not None:
        figures["baselineSource"] = source
    return figures


# --- pure helpers ------------------------------------------------------------------------------------


def seed_state(samplergroups: Sequence[Mapping[str, Any]]) -> RebalanceState:
    """After an operator restart: continue from the shares, throughput and history in status."""
    state = RebalanceState()
    for sg in samplergroups:
        status = sg.get("status") or {}
        name = (sg.get("spec") or {}).get("name")
        if not name or status.get("share") is None:
            continue
        history = [dict(h) for h in status.get("shareHistory") or []]
        state.groups[name] = GroupMemory(
            ema_tokens_per_second=status.get("tokensPerSecond"),
            share=status.get("share"),
            recorded_share=history[-1]["to"] if history else status.get("share"),
            history=history,
        )
    return state


def rate_window(interval_seconds: int) -> int:
    """Seconds of the Prometheus rate a group's throughput is read over (`spec.router.prometheusUrl`)."""
    return max(2 * interval_seconds, 60)


def prometheus_query(namespace: str, samplergroup: str, window_seconds: int) -> str:
    """Decode tokens/s of a group's pods (Deployment pods are <samplergroup>-<rs hash>-<pod hash>), from
    SGLang's per-step `realtime_tokens_total{mode="decode"}`, not the finish-time
    `generation_tokens_total` (0 for minutes while long rollouts run; rebalance.py)."""
    selector = f'mode="decode",namespace="{namespace}",pod=~"{samplergroup}-[a-z0-9]+-[a-z0-9]+"'
    return f"sum(rate(sglang:realtime_tokens_total{{{selector}}}[{window_seconds}s]))"


def fleet_plan_status(memory: JobMemory) -> dict[str, Any] | None:
    """RLJob `status.fleetPlan` of the optimizer's last decision (None: none since the operator started)."""
    return memory.plan.status() if memory.plan is not None else None


def remembered_status(memory: JobMemory, group: str) -> dict[str, Any] | None:
    """A group's SamplerGroup status fields that keep this memory over a restart (status.REMEMBERED_FIELDS):
    `steadyThroughput` (the optimizer's last steady figure) and `precisionCooldown` (the autopilot's
    step-down state), each absent when there is none; None before the job's first sight since the
    operator started (the observed ones are kept: the memory is restored from them then, `_due`)."""
    if memory.state is None:
        return None
    figure, cooldown = memory.fleet.steady.get(group), autopilot.cooldown_status(memory.precision, group)
    return {k: v for k, v in (("steadyThroughput", figure.status() if figure else None), ("precisionCooldown", cooldown)) if v}


def precision_autopilot_status(memory: JobMemory) -> dict[str, str] | None:
    """RLJob `status.precisionAutopilot`: the autopilot's last change per group since the operator started
    (None: none)."""
    return dict(memory.precision_changes) or None


def job_config(job: RLJob) -> RebalanceConfig:
    r = job.spec.router
    reference = r.reference
    accelerator = reference.accelerator or job.spec.trainer.accelerator
    price: float | None = reference.cost_per_gpu_hour
    if price is None:
        try:
            price = get_catalog().get(accelerator).cost_per_gpu_hour
        except (CatalogError, KeyError):
            price = None
    return RebalanceConfig(
        policy=r.policy,
        max_share_change=r.max_share_change,
        min_share=r.min_share,
        smoothing=r.smoothing,
        reference_accelerator=accelerator,
        reference_price_per_gpu_hour=price,
        reference_tokens_per_gpu_second=reference.tokens_per_gpu_second,
        reference_oor_fraction=reference.oor_fraction,
        catalog=get_catalog(),
    )


def group_input(
    job: RLJob,
    sg: Mapping[str, Any],
    pods: Mapping[str, PodSample],
    trainer: Mapping[str, float],
    tokens_per_second: float | None,
    collapse_quarantine: frozenset[str] = frozenset(),
) -> GroupInput:
    spec = sg.get("spec") or {}
    status = sg.get("status") or {}
    accelerator = spec.get("accelerator", "")
    try:
        cls = get_catalog().get(accelerator)
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
        quarantined=st.quarantine_reason(dict(sg), collapse_quarantine) is not None,
        static_share=job.spec.router.static_shares.get(name),
        tokens_per_second=tokens_per_second,
        egress_price_per_gb=spec.get("egressPricePerGb"),
    )


def invalid_tokens(trainer: Mapping[str, float]) -> dict[str, float]:
    """A group's invalid tokens by validation reason from its trainer metrics (`invalid_reason_<reason>`,
    trainer/metrics.py `invalid_token_metrics`), the counts > 0."""
    return {k[len(INVALID_METRIC_PREFIX) :]: v for k, v in trainer.items() if k.startswith(INVALID_METRIC_PREFIX) and v > 0}


def trainer_metrics_url(pod: Mapping[str, Any]) -> str:
    """The exporter of trainer rank 0 (`rlfleet_trainer_*`); `pod` is a `pods.pod_view`."""
    return f"http://{pod['podIP']}:{n.TRAINER_METRICS_PORT}/metrics"


# --- I/O -----------------------------------------------------------------------------------------------


async def _get_text(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url, timeout=HTTP_TIMEOUT) as response:
            return await response.text() if response.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


async def scrape_pods(http: aiohttp.ClientSession, pods: Sequence[Mapping[str, Any]], port: int) -> dict[str, PodSample]:
    async def one(pod: Mapping[str, Any]) -> tuple[str, PodSample | None]:
        text = await _get_text(http, f"http://{pod['podIP']}:{port}/metrics")
        try:
            return pod["name"], parse_sglang_metrics(text) if text else None
        except ValueError:
            return pod["name"], None

    results = await asyncio.gather(*(one(p) for p in pods))
    return {name: sample for name, sample in results if sample is not None}


async def prometheus_tokens_per_second(
    http: aiohttp.ClientSession, url: str, query: str
) -> float | None:
    text = await _get_text(http, f"{url.rstrip('/')}/api/v1/query?query={quote(query)}")
    if text is None:
        return None
    try:
        result = json.loads(text)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def admin_token(api: kube.KubeApi, job: RLJob, namespace: str) -> str | None:
    secret = await api.get("v1", "Secret", namespace, job.spec.router.admin_token_secret or n.router_secret_name(job.name))
    data = (secret or {}).get("data") or {}
    if "token" not in data:
        return None
    return base64.b64decode(data["token"]).decode().strip() or None


async def push_to_router(
    http: aiohttp.ClientSession,
    router_url: str,
    token: str,
    result: RebalanceResult,
    quarantined: Mapping[str, bool],
) -> bool:
    """Quarantine per group, then all shares at once. False when the router refused or is unreachable."""
    headers = {"Authorization": f"Bearer {token}"}
    try:
        for group, quarantine in quarantined.items():
            async with http.put(f"{router_url}/admin/groups/{quote(group)}", json={"quarantined": quarantine},
                                headers=headers, timeout=HTTP_TIMEOUT) as response:  # fmt: skip
                if response.status != 200:
                    log.warning("router %s refused group %s: HTTP %s", router_url, group, response.status)
                    return False
        reason = "; ".join(result.changes)[:500] or "rebalance"
        async with http.put(f"{router_url}/admin/shares", json={"shares": result.shares, "reason": reason},
                            headers=headers, timeout=HTTP_TIMEOUT) as response:  # fmt: skip
            return response.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        log.info("router %s unreachable: %s", router_url, exc)
        return False


PodsOf = Callable[[str, str], list[dict[str, Any]]]  # (component, owner name) -> pod views of the namespace


async def rebalance_job(body: Mapping[str, Any], namespace: str, samplergroups: Sequence[Mapping[str, Any]],
                        pods_of: PodsOf, now: float | None = None) -> RebalanceResult | None:  # fmt: skip
    """The trainer's report read (at every call), then one rebalance of one RLJob (if its interval has
    elapsed): scrape, decide, push to the routers, post
    share-change Events, and keep the result and the trainer's report in memory for the status pipeline.
    `samplergroups` and `pods_of` come from the operator's indexes. Returns the result when it ran."""
    job = parsed_jobs.parse(body)
    if isinstance(job, str):
        return None  # the RLJob handlers report invalid specs
    if job.spec.suspend:
        return None
    now = time.time() if now is None else now
    key = (namespace, job.name, str(body.get("metadata", {}).get("uid", "")))
    memory = _JOBS.setdefault(key, JobMemory())
    samplergroups = [sg for sg in samplergroups if not sg["metadata"].get("deletionTimestamp")]
    async with aiohttp.ClientSession() as http:
        # At every tick, not only when shares are due: the status shows the trainer's step, reward and KL
        # from its first step (the first rebalance comes one interval after the job is first seen).
        trainer_metrics = await _read_trainer(http, job, pods_of, memory)
        if not samplergroups or not _due(memory, samplergroups, now, job.spec.router.rebalance_interval_seconds):
            return None
        memory.last_run = now
        collapse = trainer_job_status(body, samplergroups, memory.report, st.now_iso()).quarantine
        inputs = await _group_inputs(http, job, namespace, samplergroups, pods_of, trainer_metrics, collapse)
        if job.spec.router.autopilot.enabled:
            inputs = await run_autopilot(job, namespace, samplergroups, inputs, memory)
        config = job_config(job)
        stored = memory.weights_stored_bytes
        result = rebalance(inputs, memory.state, now, config, weights_stored_bytes=stored)
        if job.spec.router.optimize.enabled:
            decision = plan_fleet_mix(job, samplergroups, inputs, result, memory, config)
            if decision.shares is not None:  # the plan's shares instead of the policy's, bounded alike
                planned = [replace(g, static_share=decision.shares.get(g.name, 0.0)) for g in inputs]
                result = rebalance(planned, memory.state, now, replace(config, policy="plan", min_share=0.0),
                                   weights_stored_bytes=stored)  # fmt: skip
            await _scale(namespace, samplergroups, decision)
        memory.state = result.state

        memory.token = memory.token or await admin_token(kube.api(), job, namespace)
        if memory.token:
            quarantined = {g.name: g.quarantined for g in inputs}
            for pod in (p for p in pods_of("router", job.name) if pod_ready(p)):
                url = f"http://{pod['podIP']}:{n.ROUTER_PORT}"
                await push_to_router(http, url, memory.token, result, quarantined)
    memory.result = result
    export_economics(namespace, job.name, result)
    _post_share_events(samplergroups, result)
    return result


def plan_fleet_mix(job: RLJob, samplergroups: Sequence[Mapping[str, Any]], inputs: Sequence[GroupInput],
                   result: RebalanceResult, memory: JobMemory, config: RebalanceConfig) -> fleetplan.FleetDecision:  # fmt: skip
    """The optimizer's decision of this interval from the share policy's readings (`result`: this
    interval's tokens/s per group, its views' stored bytes/s that price a group's weight traffic, the
    reference fleet's figures, the policy's shares); kept in `memory` for the status."""
    by_name = {g.name: g for g in inputs}
    catalog = config.catalog or get_catalog()
    readings = []
    for sg in samplergroups:
        g = by_name[(sg.get("spec") or {}).get("name", "")]
        try:
            default_tp = catalog.get(g.accelerator).default_tensor_parallel
        except (CatalogError, KeyError):
            default_tp = 1
        egress = replica_egress_cost_per_hour(g.egress_price_per_gb, g.weight_format, result.state)
        readings.append(fleetplan.fleet_reading(sg, g.price_per_gpu_hour, default_tp,
                                                result.groups[g.name].measured_tokens_per_second,
                                                g.kl, g.oor_fraction, g.quarantined, egress))  # fmt: skip
    router = job.spec.router
    # a Prometheus rate spans its window: a replica change shows in it for that long (rebalancer's window)
    settle = math.ceil(rate_window(router.rebalance_interval_seconds) / router.rebalance_interval_seconds) if router.prometheus_url else 1
    memory.fleet = fleetplan.observe(memory.fleet, readings, settle, st.now_iso())
    figures = fleetplan.plan_figures(readings, memory.fleet, catalog)
    economics = result.economics
    reference = fleetplan.ReferenceFigures(
        accelerator=config.reference_accelerator,
        tokens_per_gpu_second=economics.reference_tokens_per_gpu_second,
        cost_per_gpu_hour=config.reference_price_per_gpu_hour,
        oor_fraction=config.reference_oor_fraction,
    )
    held = {g: "precision autopilot: settling after a precision change" for g in memory.precision.settling}
    trainer = memory.report.fleet if memory.report is not None else {}
    request, left_out = fleetplan.fleet_request(job.spec.router.optimize, job.spec.trainer.accelerator, reference,
                                                readings, {g: f.tokens_per_second_per_replica for g, f in figures.items()},
                                                held, trainer)  # fmt: skip
    _, demand_source = fleetplan.demand_of(job.spec.router.optimize, trainer)
    memory.plan = fleetplan.decide(request, left_out, readings, result.shares, catalog, demand_source, figures)
    return memory.plan


async def run_autopilot(job: RLJob, namespace: str, samplergroups: Sequence[Mapping[str, Any]],
                        inputs: Sequence[GroupInput], memory: JobMemory) -> list[GroupInput]:  # fmt: skip
    """The precision autopilot's interval (autopilot.py): each step patches the SamplerGroup's weightFormat
    (an override the RLJob's spec does not own: builders.build_samplergroup keeps it), each quarantine
    sets its `rlfleet.dev/quarantined` annotation (the one quarantine path, status.quarantine_reason); an
    Event each. Returns the inputs with this interval's quarantines applied."""
    optimize = job.spec.router.optimize
    by_name = {g.name: g for g in inputs}
    floors = {group.name: group.weight_format for group in job.spec.sampler_groups}  # no step down below the RLJob's
    readings = []
    for sg in samplergroups:
        spec = sg.get("spec") or {}
        g = by_name[spec.get("name", "")]
        max_kl, max_oor = autopilot.group_budgets(optimize, g.name)
        readings.append(autopilot.AutopilotReading(
            name=g.name, accelerator=g.accelerator, weight_format=g.weight_format,
            kv_cache_dtype=spec.get("kvCacheDtype", "auto"), kl=g.kl, oor_fraction=g.oor_fraction,
            max_kl=max_kl, max_oor_fraction=max_oor, quarantined=g.quarantined,
            floor_format=floors.get(g.name), trained_fraction=g.trained_fraction, invalid_tokens=g.invalid_tokens,
            max_invalid_fraction=job.spec.router.autopilot.max_invalid_fraction,
        ))  # fmt: skip
    published = views_to_publish(group.weight_format for group in job.spec.sampler_groups)
    spec = job.spec.router.autopilot
    step_down = autopilot.StepDown(spec.cooldown_intervals, spec.max_cooldown_intervals) if spec.step_down else None
    actions, memory.precision = autopilot.autopilot(readings, memory.precision, spec.patience, published,
                                                    get_catalog(), step_down)  # fmt: skip
    quarantined: set[str] = set()
    by_group = {(sg.get("spec") or {}).get("name", ""): sg for sg in samplergroups}
    for action in actions:
        sg = by_group[action.group]
        if action.kind in ("step", "step-down"):
            body: dict[str, Any] = {"spec": {"weightFormat": action.to_format}}
            event_type, reason = "Normal", "PrecisionStepped" if action.kind == "step" else "PrecisionSteppedDown"
        else:
            body = {"metadata": {"annotations": {st.ANN_QUARANTINED: "true"}}}
            event_type, reason = "Warning", "PrecisionQuarantined"
        try:
            await kube.api().patch(sg["apiVersion"], sg["kind"], namespace, sg["metadata"]["name"], body)
        except kube.KubeError as exc:
            kopf.event(kube.event_target(sg), type="Warning", reason="PrecisionChangeFailed",
                       message=f"{action.reason}: {exc}"[:1000])  # fmt: skip
            continue
        kopf.event(kube.event_target(sg), type=event_type, reason=reason, message=action.reason[:1000])
        memory.precision_changes[action.group] = st.clip(action.reason)
        if action.kind == "quarantine":
            quarantined.add(action.group)
    return [replace(g, quarantined=True) if g.name in quarantined else g for g in inputs]


async def _scale(namespace: str, samplergroups: Sequence[Mapping[str, Any]], decision: fleetplan.FleetDecision) -> None:
    """Each SamplerGroup whose replicas the decision changes, through its scale subresource, with a
    FleetScaled Event saying from, to and why."""
    changes = decision.changes()
    for sg in samplergroups:
        name = (sg.get("spec") or {}).get("name", "")
        if name not in changes:
            continue
        before, after = changes[name]
        try:
            await kube.api().scale(sg["apiVersion"], sg["kind"], namespace, sg["metadata"]["name"], after)
        except kube.KubeError as exc:
            kopf.event(kube.event_target(sg), type="Warning", reason="FleetScaleFailed",
                       message=f"replicas {before} -> {after}: {exc}"[:1000])  # fmt: skip
            continue
        kopf.event(kube.event_target(sg), type="Normal", reason="FleetScaled",
                   message=f"replicas {before} -> {after} ({decision.decision}): {decision.reason}"[:1000])  # fmt: skip


def _due(memory: JobMemory, samplergroups: Sequence[Mapping[str, Any]], now: float, interval: float) -> bool:
    """Whether the job's rebalance interval has elapsed. At first sight of the job (new, or the operator
    restarted) it continues from its status and takes the first step one full interval later, so that a
    restart never moves shares early."""
    if memory.state is None:
        memory.state, memory.last_run = seed_state(samplergroups), now
        memory.fleet, memory.precision = fleetplan.restore(samplergroups), autopilot.restore(samplergroups)
        return False
    return memory.last_run is None or now - memory.last_run >= interval - TICK_SECONDS / 2


async def _read_trainer(
    http: aiohttp.ClientSession, job: RLJob, pods_of: PodsOf, memory: JobMemory
) -> dict[str, dict[str, float]]:
    """The trainer's per-group metrics, keeping its report and its stored bytes per view in `memory`
    (None when unreadable this tick: the pipeline keeps the observed step and metrics)."""
    memory.report, memory.weights_stored_bytes = None, None
    trainer_pod = next((p for p in pods_of("trainer", job.name) if p["name"] == f"{n.trainer_name(job.name)}-0"), None)
    if trainer_pod is None or not pod_ready(trainer_pod):
        return {}
    text = await _get_text(http, trainer_metrics_url(trainer_pod))
    if not text:
        return {}
    try:
        trainer_metrics, memory.report = parse_trainer_group_metrics(text), parse_trainer_report(text)
        memory.weights_stored_bytes = parse_trainer_stored_bytes(text)
    except ValueError:
        return {}
    return trainer_metrics


async def _group_inputs(
    http: aiohttp.ClientSession,
    job: RLJob,
    namespace: str,
    samplergroups: Sequence[Mapping[str, Any]],
    pods_of: PodsOf,
    trainer_metrics: Mapping[str, dict[str, float]],
    collapse: frozenset[str],
) -> list[GroupInput]:
    """Each group's rebalance input (throughput from Prometheus when configured, else scraped from
    its ready pods)."""
    prometheus = job.spec.router.prometheus_url
    window = rate_window(job.spec.router.rebalance_interval_seconds)
    inputs: list[GroupInput] = []
    for sg in samplergroups:
        spec = sg.get("spec") or {}
        sg_name = sg["metadata"]["name"]
        port = int(spec.get("port", 30000))
        pods = [p for p in pods_of("sampler", sg_name) if pod_ready(p)]
        if prometheus:
            samples: dict[str, PodSample] = {}
            tps = await prometheus_tokens_per_second(http, prometheus, prometheus_query(namespace, sg_name, window))
        else:
            samples, tps = await scrape_pods(http, pods, port), None
        inputs.append(group_input(job, sg, samples, trainer_metrics.get(spec.get("name", ""), {}), tps, collapse))
    return inputs


def _post_share_events(samplergroups: Sequence[Mapping[str, Any]], result: RebalanceResult) -> None:
    """An Event on each SamplerGroup whose share changed (Warning: Quarantined, else Normal: ShareChanged)."""
    for sg in samplergroups:
        name = (sg.get("spec") or {}).get("name")
        group = result.groups.get(name) if name is not None else None
        for line in result.changes:
            if group is not None and line.startswith(f"{name}: "):
                kopf.event(kube.event_target(sg), type="Warning" if group.quarantined else "Normal",
                           reason="Quarantined" if group.quarantined else "ShareChanged", message=line[:1000])  # fmt: skip
