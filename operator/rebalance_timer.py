"""The rebalancer's kopf timer (thin): every RLJob's `spec.router.rebalanceIntervalSeconds`.

Per interval: read each SamplerGroup's live throughput (its ready pods' SGLang /metrics, or
`spec.router.prometheusUrl`), the trainer's per-group KL / out-of-range metrics (rank 0's exporter),
call the pure `rebalance.py`, push replicas (pod URLs) and shares to every router pod's admin API,
and write the rebalancer-owned SamplerGroup status fields and the RLJob's blended cost per 1M tokens
(server-side apply as field manager `rlfleet-rebalancer`, only when something changed), with a
Kubernetes Event per share change. Importing this module registers the timer (handlers.py does).

kopf timers have a fixed interval, so the timer ticks every RLFLEET_REBALANCE_TICK seconds (5) and
acts when the job's own interval has elapsed. State (counters, EMA, history) lives in memory per job
and is re-seeded from the SamplerGroups' status after an operator restart.

Quarantine: `spec.quarantined` of the group (the RLJob's samplerGroups[].quarantined), or the
annotation `rlfleet.dev/quarantined: "true"` on the SamplerGroup (for the collapse detector / an
on-call human: `kubectl annotate sg/<job>-<group> rlfleet.dev/quarantined=true`), or, with
`spec.safety.action: quarantine-group`, a group the trainer's collapse detector quarantined.

The trainer has no API rights: from the same scrape of its exporter this timer also writes the RLJob's
step, weightVersion, metrics and CollapseRisk condition (`trainer_report.py`, pure), in the same apply as
the costs, with an Event when CollapseRisk turns on or off.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
from pydantic import ValidationError

from rlfleet.api import RLJob
from rlfleet.api.common import API_VERSION, GROUP, VERSION
from rlfleet.catalog import CatalogError, get_catalog
from rlfleet.operator import kube
from rlfleet.operator import naming as n
from rlfleet.operator import status as st
from rlfleet.operator.rebalance import (
    GroupInput,
    GroupMemory,
    PodSample,
    RebalanceConfig,
    RebalanceResult,
    RebalanceState,
    parse_sglang_metrics,
    parse_trainer_group_metrics,
    rebalance,
)
from rlfleet.operator.trainer_report import (
    TrainerReport,
    TrainerStatusResult,
    parse_trainer_report,
    trainer_job_status,
)

log = logging.getLogger("rlfleet.operator.rebalance")

TICK_SECONDS = float(os.environ.get("RLFLEET_REBALANCE_TICK", "5"))
FIELD_MANAGER = "rlfleet-rebalancer"
ANN_QUARANTINED = f"{GROUP}/quarantined"
HTTP_TIMEOUT = aiohttp.ClientTimeout(total=5, connect=2)


@dataclass
class JobMemory:
    last_run: float | None = None
    state: RebalanceState | None = None
    token: str | None = None


_JOBS: dict[tuple[str, str, str], JobMemory] = {}


# --- pure helpers ------------------------------------------------------------------------------------


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or not status.get("podIP") or pod["metadata"].get("deletionTimestamp"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def seed_state(samplergroups: list[Mapping[str, Any]]) -> RebalanceState:
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


def status_changed(observed: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> bool:
    observed = observed or {}
    for key, value in desired.items():
        have = observed.get(key)
        if isinstance(value, float) and isinstance(have, int | float):
            if not math.isclose(value, float(have), rel_tol=1e-9, abs_tol=1e-12):
                return True
        elif have != value:
            return True
    return False


def prometheus_query(namespace: str, samplergroup: str, window_seconds: int) -> str:
    """Decode tokens/s of a group's pods (Deployment pods are <samplergroup>-<rs hash>-<pod hash>), from
    SGLang's per-step `realtime_tokens_total{mode="decode"}`, not the finish-time
    `generation_tokens_total` (0 for minutes while long rollouts run; rebalance.py)."""
    selector = f'mode="decode",namespace="{namespace}",pod=~"{samplergroup}-[a-z0-9]+-[a-z0-9]+"'
    return f"sum(rate(sglang:realtime_tokens_total{{{selector}}}[{window_seconds}s]))"


def job_config(job: RLJob) -> RebalanceConfig:
    r = job.spec.router
    trainer_price: float | None
    try:
        trainer_price = get_catalog().get(job.spec.trainer.accelerator).cost_per_gpu_hour
    except (CatalogError, KeyError):
        trainer_price = None
    return RebalanceConfig(
        policy=r.policy,
        max_share_change=r.max_share_change,
        min_share=r.min_share,
        smoothing=r.smoothing,
        trainer_accelerator=job.spec.trainer.accelerator,
        trainer_price_per_gpu_hour=trainer_price,
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
    annotations = (sg.get("metadata") or {}).get("annotations") or {}
    name = spec.get("name", "")
    return GroupInput(
        name=name,
        ready_replicas=int(status.get("readyReplicas") or 0),
        gpus=int(spec.get("replicas", 1)) * int(tp),
        price_per_gpu_hour=float(price),
        pods=dict(pods),
        accelerator=accelerator,
        kl=trainer.get("kl_k3"),
        oor_fraction=trainer.get("oor_fraction"),
        token_share=trainer.get("token_share"),
        oor_share=trainer.get("oor_share"),
        quarantined=bool(spec.get("quarantined")) or annotations.get(ANN_QUARANTINED) == "true"
        or name in collapse_quarantine,
        static_share=job.spec.router.static_shares.get(name),
        tokens_per_second=tokens_per_second,
    )


def trainer_metrics_url(pod: Mapping[str, Any]) -> str:
    """The exporter of trainer rank 0 (`rlfleet_trainer_*`)."""
    return f"http://{pod['status']['podIP']}:{n.TRAINER_METRICS_PORT}/metrics"


# --- I/O -----------------------------------------------------------------------------------------------


async def _get_text(http: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with http.get(url, timeout=HTTP_TIMEOUT) as response:
            return await response.text() if response.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, OSError):
        return None


async def scrape_pods(http: aiohttp.ClientSession, pods: list[Mapping[str, Any]], port: int) -> dict[str, PodSample]:
    async def one(pod: Mapping[str, Any]) -> tuple[str, PodSample | None]:
        text = await _get_text(http, f"http://{pod['status']['podIP']}:{port}/metrics")
        try:
            return pod["metadata"]["name"], parse_sglang_metrics(text) if text else None
        except ValueError:
            return pod["metadata"]["name"], None

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
    replicas: Mapping[str, list[str]],
    quarantined: Mapping[str, bool],
) -> bool:
    """Replicas + quarantine per group, then all shares at once. False when the router is unreachable."""
    headers = {"Authorization": f"Bearer {token}"}
    try:
        for group, urls in replicas.items():
            body: dict[str, Any] = {"quarantined": quarantined.get(group, False)}
            if urls:
                body["replicas"] = urls
            async with http.put(f"{router_url}/admin/groups/{quote(group)}", json=body, headers=headers,
                                timeout=HTTP_TIMEOUT) as response:  # fmt: skip
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


async def rebalance_job(body: Mapping[str, Any], namespace: str, now: float | None = None) -> RebalanceResult | None:
    """One rebalance of one RLJob (if its interval has elapsed). Returns the result when it ran."""
    try:
        job = RLJob.from_manifest(dict(body))
    except (ValidationError, ValueError):
        return None  # the RLJob handlers report invalid specs
    if job.spec.suspend:
        return None
    now = time.time() if now is None else now
    key = (namespace, job.name, str(body.get("metadata", {}).get("uid", "")))
    memory = _JOBS.setdefault(key, JobMemory())
    if memory.last_run is not None and now - memory.last_run < job.spec.router.rebalance_interval_seconds - TICK_SECONDS / 2:
        return None
    memory.last_run = now
    api = kube.api()
    samplergroups = [
        sg for sg in await api.list(API_VERSION, "SamplerGroup", namespace, f"{n.LABEL_JOB}={job.name}")
        if not sg["metadata"].get("deletionTimestamp")
    ]  # fmt: skip
    if not samplergroups:
        return None
    if memory.state is None:
        memory.state = seed_state(samplergroups)
    prometheus = job.spec.router.prometheus_url
    window = max(2 * job.spec.router.rebalance_interval_seconds, 60)
    async with aiohttp.ClientSession() as http:
        trainer_metrics: dict[str, dict[str, float]] = {}
        report: TrainerReport | None = None
        trainer_pod = await api.get("v1", "Pod", namespace, f"{n.trainer_name(job.name)}-0")
        if trainer_pod is not None and pod_ready(trainer_pod):
            text = await _get_text(http, trainer_metrics_url(trainer_pod))
            if text:
                try:
                    trainer_metrics, report = parse_trainer_group_metrics(text), parse_trainer_report(text)
                except ValueError:
                    trainer_metrics, report = {}, None
        trainer = trainer_job_status(body, samplergroups, report, st.now_iso())
        inputs: list[GroupInput] = []
        replicas: dict[str, list[str]] = {}
        for sg in samplergroups:
            spec = sg.get("spec") or {}
            sg_name = sg["metadata"]["name"]
            port = int(spec.get("port", 30000))
            pods = [
                p for p in await api.list("v1", "Pod", namespace, f"{n.LABEL_SAMPLERGROUP}={sg_name}") if pod_ready(p)
            ]  # fmt: skip
            replicas[spec.get("name", sg_name)] = sorted(f"http://{p['status']['podIP']}:{port}" for p in pods)
            if prometheus:
                samples: dict[str, PodSample] = {}
                tps = await prometheus_tokens_per_second(http, prometheus, prometheus_query(namespace, sg_name, window))
            else:
                samples, tps = await scrape_pods(http, pods, port), None
            inputs.append(group_input(job, sg, samples, trainer_metrics.get(spec.get("name", ""), {}), tps,
                                      trainer.quarantine))  # fmt: skip
        result = rebalance(inputs, memory.state, now, job_config(job))
        memory.state = result.state

        memory.token = memory.token or await admin_token(api, job, namespace)
        if memory.token:
            routers = [
                p for p in await api.list("v1", "Pod", namespace, f"{n.LABEL_JOB}={job.name},{n.LABEL_COMPONENT}=router")
                if pod_ready(p)
            ]  # fmt: skip
            quarantined = {g.name: g.quarantined for g in inputs}
            for pod in routers:
                url = f"http://{pod['status']['podIP']}:{n.ROUTER_PORT}"
                await push_to_router(http, url, memory.token, result, replicas, quarantined)

    await write_status(api, body, samplergroups, result, trainer)
    return result


async def write_status(
    api: kube.KubeApi, job_body: Mapping[str, Any], samplergroups: list[Mapping[str, Any]], result: RebalanceResult,
    trainer: TrainerStatusResult | None = None,
) -> None:
    for sg in samplergroups:
        name = (sg.get("spec") or {}).get("name")
        group = result.groups.get(name)
        if group is None:
            continue
        desired = group.status_patch()
        if status_changed(sg.get("status"), desired):
            await _apply_status(api, sg, desired)
        for line in result.changes:
            if line.startswith(f"{name}: "):
                kopf.event(dict(sg), type="Warning" if group.quarantined else "Normal",
                           reason="Quarantined" if group.quarantined else "ShareChanged", message=line[:1000])  # fmt: skip
    costs = {
        "costPer1MTokens": None if result.fleet_cost_per_1m_tokens is None else round(result.fleet_cost_per_1m_tokens, 4),
        "baselineCostPer1MTokens": None
        if result.baseline_cost_per_1m_tokens is None
        else round(result.baseline_cost_per_1m_tokens, 4),
    }
    costs = {k: v for k, v in costs.items() if v is not None}
    # ONE apply for every RLJob field this manager owns (a field left out of an apply is removed)
    desired = {**costs, **(trainer.status if trainer else {})}
    if desired and st.status_changed(job_body.get("status"), desired):  # compares only our condition type
        await _apply_status(api, job_body, desired)
    if trainer is not None and trainer.risk_changed:
        condition = trainer.status["conditions"][0]
        kopf.event(dict(job_body), type="Warning" if trainer.risk else "Normal",
                   reason=condition["reason"] if trainer.risk else "CollapseRiskCleared",
                   message=condition["message"][:1000])  # fmt: skip


async def _apply_status(api: kube.KubeApi, obj: Mapping[str, Any], status: dict[str, Any]) -> None:
    body = {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"].get("namespace")},
        "status": status,
    }
    try:
        await api.apply(body, field_manager=FIELD_MANAGER, subresource="status")
    except kube.KubeError as exc:
        if exc.status != 404:
            raise


# On the job's WeightChannel, not on the RLJob: kopf puts a finalizer on every object with a timer, and
# deleting an RLJob must not hang while the operator is gone (docs/operations.md). The job comes from
# the operator's RLJob index (handlers.py).
@kopf.timer(GROUP, VERSION, "weightchannels", interval=TICK_SECONDS, initial_delay=TICK_SECONDS)
async def rebalance_timer(body: kopf.Body, namespace: str, **kwargs: Any) -> None:
    job_name = body.get("spec", {}).get("jobName")
    jobs = kwargs["rljobs_idx"].get((namespace, job_name)) if job_name else None
    job = next(iter(jobs), None) if jobs else None
    if job is None or job["metadata"].get("deletionTimestamp"):
        return
    try:
        await rebalance_job(copy.deepcopy(dict(job)), namespace)
    except kube.KubeError as exc:
        log.warning("rebalance of %s/%s failed: %s", namespace, body.get("metadata", {}).get("name"), exc)

