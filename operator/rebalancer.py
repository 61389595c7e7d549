"""The rebalance tick of one RLJob: the I/O around its pure decide stage (`decide.py`): observe, decide,
then act on the decisions. It writes no status and holds no timer.

Called on each tick of the job's pipelines (timer.py: the WeightChannel timer, every
RLFLEET_REBALANCE_TICK seconds). At every tick it reads the trainer's report and per-group metrics (rank
0's exporter: step, weight version, metrics, the collapse detector's state), so that the status shows
them from the first step. When the job's `spec.router.rebalanceIntervalSeconds` has elapsed since its
last decision (`Decisions.time`), `rebalance_job` observes each SamplerGroup (its ready pods' SGLang
/metrics, or `spec.router.prometheusUrl`; SamplerGroups and pods from the operator's kopf indexes, no
listing per tick) and calls the pure `decide.decide` with the previous decisions: the ones of this
process, else the RLJob's `status.decisions` (an operator restart goes on from them, nothing else is
restored). The decisions stay in memory for the status pipeline, which writes them into the RLJob's
status with the rest of it (the one status writer); then `act` carries them out: each SamplerGroup whose
decided weightFormat is not the one it has is applied again from the builder (spec + decisions; the one
apply of the pipeline's field manager), the decided replicas go through each SamplerGroup's scale
subresource (FleetScaled Events: the fleet-mix optimizer's; Scaled: the RLJob's change), quarantine and shares are pushed to every router pod's admin
API, and Events say what moved (ShareChanged, Quarantined, PrecisionStepped, PrecisionSteppedDown,
PrecisionQuarantined). The router follows each group's headless Service itself (router/membership.py),
so a pod added or replaced between two ticks is routed to as soon as it is ready.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
from prometheus_client import Gauge

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog
from rlfleet.operator import group_status, kube, parsed_jobs, replicas
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.builders import build_samplergroup
from rlfleet.operator.decide import Decisions, GroupObservation, Observations, decide, rate_window
from rlfleet.operator.pods import pod_ready
from rlfleet.operator.rebalance import (
    PodSample,
    RebalanceResult,
    parse_sglang_metrics,
    parse_trainer_group_metrics,
    parse_trainer_stored_bytes,
)
from rlfleet.operator.trainer_report import TrainerReport, parse_trainer_report, trainer_job_status

log = logging.getLogger("rlfleet.operator.rebalance")

TICK_SECONDS = float(os.environ.get("RLFLEET_REBALANCE_TICK", "5"))
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=5, connect=2)


@dataclass
class JobMemory:
    """What the tick read and decided for a job since the operator started (the pipeline's input)."""

    token: str | None = None  # the router's admin token
    report: TrainerReport | None = None  # the trainer's last readable report
    # the trainer's stored bytes per view at this tick (rebalance.py `parse_trainer_stored_bytes`; None: unreadable)
    weights_stored_bytes: dict[str, float] | None = None
    decisions: Decisions | None = None  # the latest decisions (None: none since the operator started)


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
        _set(
            GROUP_GAUGES["usable_fraction"],
            g.usable_fraction if g.tokens_per_second is not None else None,
            *labels,
        )
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
        "reference_estimated": None
        if economics.reference_basis is None
        else float(economics.reference_basis == "estimated"),
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
    figures: dict[str, float | str] = {
        k: round(v, digits) for k, (v, digits) in costs.items() if v is not None
    }
    source = result.economics.reference_source
    if source is not None:
        figures["baselineSource"] = source
    return figures


# --- pure helpers ------------------------------------------------------------------------------------


def prometheus_query(namespace: str, samplergroup: str, window_seconds: int) -> str:
    """Decode tokens/s of a group's pods (Deployment pods are <samplergroup>-<rs hash>-<pod hash>), from
    SGLang's per-step `realtime_tokens_total{mode="decode"}`, not the finish-time
    `generation_tokens_total` (0 for minutes while long rollouts run; rebalance.py)."""
    selector = f'mode="decode",namespace="{namespace}",pod=~"{samplergroup}-[a-z0-9]+-[a-z0-9]+"'
    return f"sum(rate(sglang:realtime_tokens_total{{{selector}}}[{window_seconds}s]))"


def fleet_plan_status(memory: JobMemory) -> dict[str, Any] | None:
    """RLJob `status.fleetPlan` of the optimizer's last decision (None: none since the operator started)."""
    plan = memory.decisions.plan if memory.decisions is not None else None
    return plan.status() if plan is not None else None


def precision_autopilot_status(memory: JobMemory) -> dict[str, str] | None:
    """RLJob `status.precisionAutopilot`: the autopilot's last change per group (None: none decided since
    the operator started)."""
    return dict(memory.decisions.precision_changes) or None if memory.decisions is not None else None


def decisions_status(memory: JobMemory) -> dict[str, Any] | None:
    """RLJob `status.decisions` (None: none since the operator started: the observed one stands)."""
    return memory.decisions.status() if memory.decisions is not None else None


def decisions_of(job: Mapping[str, Any]) -> Decisions | None:
    """The job's latest decisions: this process's, else the ones in its status (after a restart)."""
    return observed(job).decisions or Decisions.from_status(job.get("status"))


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


async def scrape_pods(
    http: aiohttp.ClientSession, pods: Sequence[Mapping[str, Any]], port: int
) -> dict[str, PodSample]:
    async def one(pod: Mapping[str, Any]) -> tuple[str, PodSample | None]:
        text = await _get_text(http, f"http://{pod['podIP']}:{port}/metrics")
        try:
            return pod["name"], parse_sglang_metrics(text) if text else None
        except ValueError:
            return pod["name"], None

    results = await asyncio.gather(*(one(p) for p in pods))
    return {name: sample for name, sample in results if sample is not None}


async def prometheus_tokens_per_second(http: aiohttp.ClientSession, url: str, query: str) -> float | None:
    text = await _get_text(http, f"{url.rstrip('/')}/api/v1/query?query={quote(query)}")
    if text is None:
        return None
    try:
        result = json.loads(text)["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def admin_token(api: kube.KubeApi, job: RLJob, namespace: str) -> str | None:
    secret = await api.get(
        "v1", "Secret", namespace, job.spec.router.admin_token_secret or n.router_secret_name(job.name)
    )
    data = (secret or {}).get("data") or {}
    if "token" not in data:
        return None
    return base64.b64decode(data["token"]).decode().strip() or None


async def push_to_router(
    http: aiohttp.ClientSession, router_url: str, token: str, decisions: Decisions
) -> bool:
    """The decisions' quarantine per group, then all their shares at once. False when the router refused or
    is unreachable."""
    headers = {"Authorization": f"Bearer {token}"}
    changes = decisions.result.changes if decisions.result is not None else ()
    try:
        for group, quarantine in decisions.quarantined.items():
            async with http.put(
                f"{router_url}/admin/groups/{quote(group)}",
                json={"quarantined": quarantine},
                headers=headers,
                timeout=HTTP_TIMEOUT,
            ) as response:
                if response.status != 200:
                    log.warning("router %s refused group %s: HTTP %s", router_url, group, response.status)
                    return False
        reason = "; ".join(changes)[:500] or "rebalance"
        async with http.put(
            f"{router_url}/admin/shares",
            json={"shares": decisions.shares, "reason": reason},
            headers=headers,
            timeout=HTTP_TIMEOUT,
        ) as response:
            return response.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        log.info("router %s unreachable: %s", router_url, exc)
        return False


PodsOf = Callable[[str, str], list[dict[str, Any]]]  # (component, owner name) -> pod views of the namespace


async def rebalance_job(
    body: Mapping[str, Any],
    namespace: str,
    samplergroups: Sequence[Mapping[str, Any]],
    pods_of: PodsOf,
    now: float | None = None,
) -> Decisions | None:
    """The trainer's report read (at every call), then, when the job's interval has elapsed since its last
    decision, one observation and decision of the job, kept in memory for the status pipeline and `act`.
    `samplergroups` and `pods_of` come from the operator's indexes. Returns the decisions when it decided."""
    job = parsed_jobs.parse(body)
    if isinstance(job, str):
        return None  # the RLJob handlers report invalid specs
    if job.spec.suspend:
        return None
    now = time.time() if now is None else now
    key = (namespace, job.name, str(body.get("metadata", {}).get("uid", "")))
    memory = _JOBS.setdefault(key, JobMemory())
    samplergroups = [sg for sg in samplergroups if not sg["metadata"].get("deletionTimestamp")]
    previous = memory.decisions or Decisions.from_status(body.get("status"))
    async with aiohttp.ClientSession() as http:
        # At every tick, not only when shares are due: the status shows the trainer's step, reward and KL
        # from its first step.
        trainer_metrics = await _read_trainer(http, job, pods_of, memory)
        interval = job.spec.router.rebalance_interval_seconds
        if not samplergroups or (previous is not None and now - previous.time < interval - TICK_SECONDS / 2):
            return None
        collapse = trainer_job_status(body, samplergroups, memory.report, st.now_iso()).quarantine
        groups = await _observe_groups(http, job, namespace, samplergroups, pods_of, trainer_metrics)
    fleet = memory.report.fleet if memory.report is not None else {}
    observations = Observations(groups, collapse, fleet, memory.weights_stored_bytes)
    memory.decisions = decide(job, observations, previous, now, get_catalog())
    if memory.decisions.result is not None:
        export_economics(namespace, job.name, memory.decisions.result)
    return memory.decisions


async def act(
    body: Mapping[str, Any],
    namespace: str,
    samplergroups: Sequence[Mapping[str, Any]],
    pods_of: PodsOf,
    decisions: Decisions,
) -> None:
    """Carry out a job's decisions (after the status pipeline wrote them): each SamplerGroup whose decided
    weightFormat it does not have yet is applied again from the builder, the decided replicas go through
    /scale, the routers are told the shares and quarantines, and Events say what moved."""
    job = parsed_jobs.parse(body)
    if isinstance(job, str):
        return
    by_group = {(sg.get("spec") or {}).get("name", ""): sg for sg in samplergroups}
    templates = {g.name: g for g in job.spec.sampler_groups}
    formats = decisions.weight_formats(job)
    for name, sg in by_group.items():
        if (
            name in formats
            and name in templates
            and (sg.get("spec") or {}).get("weightFormat") != formats[name]
        ):
            await replicas.hand_over(sg)  # an older operator's apply owns them: before an apply without them
            await kube.api().apply(
                build_samplergroup(job, templates[name], namespace, dict(body), formats[name])
            )
    _post_precision_events(by_group, decisions)
    await _scale(namespace, samplergroups, decisions)
    memory = observed(body)
    memory.token = memory.token or await admin_token(kube.api(), job, namespace)
    if memory.token:
        async with aiohttp.ClientSession() as http:
            for pod in (p for p in pods_of("router", job.name) if pod_ready(p)):
                await push_to_router(http, f"http://{pod['podIP']}:{n.ROUTER_PORT}", memory.token, decisions)
    if decisions.result is not None:
        _post_share_events(samplergroups, decisions.result)


def _post_precision_events(by_group: Mapping[str, Mapping[str, Any]], decisions: Decisions) -> None:
    """An Event per precision autopilot action of this decision on its SamplerGroup."""
    for action in decisions.actions:
        sg = by_group.get(action.group)
        if sg is None:
            continue
        if action.kind == "quarantine":
            event_type, reason = "Warning", "PrecisionQuarantined"
        else:
            event_type, reason = (
                "Normal",
                "PrecisionStepped" if action.kind == "step" else "PrecisionSteppedDown",
            )
        kopf.event(kube.event_target(sg), type=event_type, reason=reason, message=action.reason[:1000])


async def _scale(namespace: str, samplergroups: Sequence[Mapping[str, Any]], decisions: Decisions) -> None:
    """Each SamplerGroup whose spec.replicas is not the decided, through its scale subresource, with an
    Event saying from, to and why: FleetScaled (the optimizer's plan), else Scaled (the RLJob's change)."""
    plan = decisions.plan
    planned = plan.changes() if plan is not None else {}
    for sg in samplergroups:
        name = (sg.get("spec") or {}).get("name", "")
        decided = decisions.groups.get(name)
        before = int((sg.get("spec") or {}).get("replicas", 1))
        if decided is None or decided.replicas == before:
            continue
        after, fleet = decided.replicas, name in planned
        try:
            await kube.api().scale(sg["apiVersion"], sg["kind"], namespace, sg["metadata"]["name"], after)
        except kube.KubeError as exc:
            kopf.event(
                kube.event_target(sg),
                type="Warning",
                reason="FleetScaleFailed" if fleet else "ScaleFailed",
                message=f"replicas {before} -> {after}: {exc}"[:1000],
            )
            continue
        why = (
            f" ({plan.decision}): {plan.reason}"
            if fleet and plan is not None
            else f": {decided.replicas_reason}"
        )
        kopf.event(
            kube.event_target(sg),
            type="Normal",
            reason="FleetScaled" if fleet else "Scaled",
            message=f"replicas {before} -> {after}{why}"[:1000],
        )


async def _read_trainer(
    http: aiohttp.ClientSession, job: RLJob, pods_of: PodsOf, memory: JobMemory
) -> dict[str, dict[str, float]]:
    """The trainer's per-group metrics, keeping its report and its stored bytes per view in `memory`
    (None when unreadable this tick: the pipeline keeps the observed step and metrics)."""
    memory.report, memory.weights_stored_bytes = None, None
    trainer_pod = next(
        (p for p in pods_of("trainer", job.name) if p["name"] == f"{n.trainer_name(job.name)}-0"), None
    )
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


async def _observe_groups(
    http: aiohttp.ClientSession,
    job: RLJob,
    namespace: str,
    samplergroups: Sequence[Mapping[str, Any]],
    pods_of: PodsOf,
    trainer_metrics: Mapping[str, dict[str, float]],
) -> tuple[GroupObservation, ...]:
    """Each group as the decision reads it (throughput from Prometheus when configured, else scraped from
    its ready pods)."""
    prometheus = job.spec.router.prometheus_url
    window = rate_window(job.spec.router.rebalance_interval_seconds)
    out: list[GroupObservation] = []
    for sg in samplergroups:
        spec = sg.get("spec") or {}
        sg_name = sg["metadata"]["name"]
        port = int(spec.get("port", 30000))
        pods = [p for p in pods_of("sampler", sg_name) if pod_ready(p)]
        if prometheus:
            samples: dict[str, PodSample] = {}
            tps = await prometheus_tokens_per_second(
                http, prometheus, prometheus_query(namespace, sg_name, window)
            )
        else:
            samples, tps = await scrape_pods(http, pods, port), None
        name = spec.get("name", "")
        out.append(
            GroupObservation(
                name=name,
                replicas=int(spec.get("replicas", 1)),
                ready_replicas=int((sg.get("status") or {}).get("readyReplicas") or 0),
                pods=samples,
                tokens_per_second=tps,
                trainer=trainer_metrics.get(name, {}),
                annotation=(sg["metadata"].get("annotations") or {}).get(group_status.ANN_QUARANTINED),
            )
        )
    return tuple(out)


def _post_share_events(samplergroups: Sequence[Mapping[str, Any]], result: RebalanceResult) -> None:
    """An Event on each SamplerGroup whose share changed (Warning: Quarantined, else Normal: ShareChanged)."""
    for sg in samplergroups:
        name = (sg.get("spec") or {}).get("name")
        group = result.groups.get(name) if name is not None else None
        for line in result.changes:
            if group is not None and line.startswith(f"{name}: "):
                kopf.event(
                    kube.event_target(sg),
                    type="Warning" if group.quarantined else "Normal",
                    reason="Quarantined" if group.quarantined else "ShareChanged",
                    message=line[:1000],
                )
