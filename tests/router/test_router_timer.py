"""The rebalance tick's pieces that need no cluster: the quarantine path, fleet costs, catalog inputs,
the Prometheus query, and pushing a result to a real router service over its admin API."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from support.fake_prometheus import fake_prometheus
from support.manifests import rljob
from support.upstreams import serving

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog
from rlfleet.operator import decide
from rlfleet.operator import rebalancer as timer
from rlfleet.operator.decide import Decisions, GroupDecision
from rlfleet.operator.rebalance import GroupInput, RebalanceConfig, rebalance
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.core import Router
from rlfleet.router.service import TokenSource, build_app

JOB = rljob(
    "j",
    [
        {"name": "h100-fp8", "accelerator": "h100", "replicas": 2, "weightFormat": "fp8"},
        {"name": "a100-bf16", "accelerator": "a100", "replicas": 1, "tensorParallel": 2},
    ],
    "ns",
)


def samplergroup(name: str, status: dict | None = None, **spec) -> dict:
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": f"j-{name}", "namespace": "ns", "annotations": spec.pop("annotations", {})},
        "spec": {"name": name, **spec},
        "status": status or {},
    }


def test_group_input_takes_price_gpus_quarantine_and_trainer_metrics_from_the_right_places() -> None:
    from rlfleet.catalog import get_catalog

    job = RLJob.from_manifest(JOB)
    sg = samplergroup(
        "a100-bf16",
        {"readyReplicas": 1},
        accelerator="a100",
        replicas=1,
        tensorParallel=2,
        annotations={"rlfleet.dev/quarantined": "true"},
    )
    inp = decide.group_input(job, sg, {}, {"kl_k3": 0.01, "oor_fraction": 0.002}, tokens_per_second=123.0)
    assert inp.price_per_gpu_hour == get_catalog().get("a100").cost_per_gpu_hour
    assert (inp.gpus, inp.ready_replicas, inp.quarantined) == (2, 1, True)
    assert inp.tensor_parallel == 2  # a demand-limited group's capacity prior counts its pods' GPUs
    assert (inp.kl, inp.oor_fraction, inp.tokens_per_second) == (0.01, 0.002, 123.0)
    plain = decide.group_input(
        job, samplergroup("h100-fp8", {}, accelerator="h100", replicas=2), {}, {}, None
    )
    assert (plain.gpus, plain.ready_replicas, plain.quarantined) == (2, 0, False)
    config = decide.job_config(job, get_catalog())
    assert config.reference_accelerator == "b200" and config.max_share_change == 0.1
    assert config.reference_price_per_gpu_hour == get_catalog().get("b200").cost_per_gpu_hour


def test_collapse_quarantine_goes_through_the_one_quarantine_path() -> None:
    job = RLJob.from_manifest(JOB)
    sg = samplergroup("h100-fp8", {"readyReplicas": 2}, accelerator="h100", replicas=2)
    assert not decide.group_input(job, sg, {}, {}, None).quarantined
    assert decide.group_input(job, sg, {}, {}, None, frozenset({"h100-fp8"})).quarantined


def test_a_groups_routing_mismatch_goes_from_the_trainers_metrics_to_its_status() -> None:
    """A mixture of experts: the trainer's per-group routing_mismatch_tokens (trainer/backends/routing.py) becomes
    the SamplerGroup's status.routingMismatch; a dense model's trainer reports none, and the status has none."""
    job = RLJob.from_manifest(JOB)
    moe = {
        "kl_k3": 0.01,
        "oor_fraction": 0.002,
        "routing_mismatch_tokens": 0.0625,
        "routing_mismatch_layers": 0.03125,
    }
    inputs = [
        decide.group_input(job, samplergroup("h100-fp8", {}, accelerator="h100", replicas=2), {}, moe, 10.0),
        decide.group_input(job, samplergroup("a100-bf16", {}, accelerator="a100"), {}, {"kl_k3": 0.01}, 10.0),
    ]
    assert inputs[0].routing_mismatch == 0.0625 and inputs[1].routing_mismatch is None
    result = rebalance(inputs, None, 0.0, RebalanceConfig())
    assert result.groups["h100-fp8"].status_patch()["routingMismatch"] == 0.0625
    assert "routingMismatch" not in result.groups["a100-bf16"].status_patch()


def test_fleet_costs_are_rounded_and_unknown_ones_dropped() -> None:
    inputs = [
        GroupInput("a", 1, 1, 2.0, tokens_per_second=300.0),
        GroupInput("b", 1, 1, 1.0, tokens_per_second=100.0),
    ]
    result = rebalance(inputs, None, 0.0, RebalanceConfig())
    # $3/h of GPUs over 400 tok/s (no token out of range) = 3 / 3600 / 400 * 1e6 $ per 1M tokens; no
    # trainer price: no baseline, no saving
    assert timer.fleet_costs(result) == {"costPer1MTokens": round(3 / 3600 / 400 * 1e6, 4)}
    assert timer.fleet_costs(rebalance([GroupInput("a", 0, 1, 1.0)], None, 0.0, RebalanceConfig())) == {}


def test_fleet_costs_count_usable_tokens_and_the_saving_against_the_trainer_class_at_bf16() -> None:
    inputs = [
        # the trainer's class at bf16: the reference, 2 GPUs at $6 making 2000 tok/s, 10% out of range
        GroupInput("b200-bf16", 1, 2, 6.0, accelerator="b200", tokens_per_second=2000.0, oor_fraction=0.1),
        # the trainer's class at nvfp4: not the reference
        GroupInput(
            "b200-nvfp4",
            1,
            1,
            6.0,
            accelerator="b200",
            weight_format="nvfp4",
            tokens_per_second=3000.0,
            oor_fraction=0.2,
        ),
        GroupInput(
            "h100-fp8",
            1,
            4,
            2.0,
            accelerator="h100",
            weight_format="fp8",
            tokens_per_second=3000.0,
            oor_fraction=0.0,
        ),
    ]
    result = rebalance(inputs, None, 0.0, RebalanceConfig(reference_accelerator="b200"))
    # fleet: $12 + $6 + $8 = $26/h over 1800 + 2400 + 3000 = 7200 usable tok/s
    # reference: $6/GPU-h over 1000 tok/s per GPU x 0.9 = 900 usable tok/s per GPU
    fleet, reference = 26 / 3600 / 7200 * 1e6, 6 / 3600 / 900 * 1e6
    assert timer.fleet_costs(result) == {
        "costPer1MTokens": round(fleet, 4),
        "baselineCostPer1MTokens": round(reference, 4),
        "savingPercent": round(100 * (1 - (26 / 7200) / (6 / 900)), 2),  # 45.83
        "baselineSource": "b200 bf16 measured on the fleet's b200 bf16 groups",
    }
    assert timer.fleet_costs(result)["savingPercent"] == 45.83
    patch = result.groups["b200-nvfp4"].status_patch()
    assert patch["costPerHour"] == 6.0 and patch["costPer1MTokens"] == round(6 / 3600 / 2400 * 1e6, 4)


def test_pod_ready() -> None:
    from rlfleet.operator.pods import pod_ready, pod_view

    ready = {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert pod_ready(pod_view(ready))
    assert not pod_ready(pod_view({**ready, "metadata": {"name": "p", "deletionTimestamp": "x"}}))
    assert not pod_ready(pod_view({"metadata": {}, "status": {**ready["status"], "conditions": []}}))


async def test_prometheus_rate_is_read_from_a_real_http_api() -> None:
    with fake_prometheus(lambda samplergroup: 1234.5 if samplergroup == "j-h100-fp8" else 0.0) as (url, seen):
        async with aiohttp.ClientSession() as http:
            q = timer.prometheus_query("ns", "j-h100-fp8", 60)
            assert await timer.prometheus_tokens_per_second(http, url, q) == 1234.5
            assert await timer.prometheus_tokens_per_second(http, "http://127.0.0.1:1", q) is None
    # the per-step decode counter, not the finish-time sglang:generation_tokens_total (rebalance.py)
    assert seen == [
        'sum(rate(sglang:realtime_tokens_total{mode="decode",namespace="ns",'
        'pod=~"j-h100-fp8-[a-z0-9]+-[a-z0-9]+"}[60s]))'
    ]


async def test_push_to_router_sends_quarantine_and_shares_and_no_replicas(monkeypatch) -> None:
    """The push's bodies, as a real router app receives them: each decided quarantine, then every share; the
    replicas are the router's own (router/membership.py), so the push leaves them as they are."""
    monkeypatch.setenv("RLFLEET_ROUTER_ADMIN_TOKEN", "tok")
    config = RouterConfig(
        groups=[
            GroupConfig(name="a", replicas=["http://10.0.0.1:30000", "http://10.0.0.2:30000"]),
            GroupConfig(name="b", replicas=["http://10.0.1.1:30000"]),
        ]
    )
    router = Router(config)
    app = build_app(router, TokenSource(None, "RLFLEET_ROUTER_ADMIN_TOKEN"))
    received: list[tuple[str, str, object]] = []

    @web.middleware
    async def record(request: web.Request, handler):
        received.append((request.method, request.path, await request.json()))
        return await handler(request)

    app.middlewares.append(record)
    inputs = [
        GroupInput("a", 1, 1, 1.0, tokens_per_second=300.0),
        GroupInput("b", 1, 1, 1.0, tokens_per_second=100.0),
    ]
    result = rebalance(inputs, None, 0.0, RebalanceConfig(max_share_change=1.0, min_share=0.0))
    decisions = Decisions(
        0.0,
        {g: GroupDecision(g, 1, "", "bf16", "", result.shares[g], "", g == "b", "", "bf16") for g in "ab"},
        result=result,
    )
    async with serving(app) as url:
        async with aiohttp.ClientSession() as http:
            assert await timer.push_to_router(http, url, "tok", decisions)
            pushed = list(received)
            assert not await timer.push_to_router(http, url, "wrong", decisions)
            assert not await timer.push_to_router(http, "http://127.0.0.1:1", "tok", decisions)
        assert pushed == [
            ("PUT", "/admin/groups/a", {"quarantined": False}),
            ("PUT", "/admin/groups/b", {"quarantined": True}),
            (
                "PUT",
                "/admin/shares",
                {
                    "shares": {"a": 0.75, "b": 0.25},
                    "reason": "a: share 0.500 -> 0.750 "
                    "(throughput 300 tok/s); b: share 0.500 -> 0.250 (throughput 100 tok/s)",
                },
            ),
        ]
        table = router.table
        assert table.groups["b"].quarantined and table.effective_shares() == {"a": 1.0, "b": 0.0}
        assert table.groups["a"].share == pytest.approx(0.75)
        assert {g: list(table.groups[g].replicas) for g in "ab"} == {
            g.name: g.replicas for g in config.groups
        }


def test_the_operators_router_config_is_a_valid_router_config() -> None:
    """Contract with operator/builders.py: the ConfigMap it writes is what `rlfleet router serve` reads."""
    from pathlib import Path

    from rlfleet.api import load_rljob
    from rlfleet.operator import builders

    job = load_rljob(Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml")
    config = RouterConfig.model_validate(builders.router_config(job, "ns"))
    assert [g.name for g in config.groups] == [g.name for g in job.spec.sampler_groups]
    assert config.admin_token_file and all(len(g.replicas) == 1 for g in config.groups)


def test_economics_gauges_per_group_and_job_and_their_removal() -> None:
    from prometheus_client import REGISTRY

    inputs = [
        GroupInput("b200-bf16", 1, 2, 6.0, accelerator="b200", tokens_per_second=2000.0, oor_fraction=0.1),
        GroupInput("h100-fp8", 1, 4, 2.0, accelerator="h100", weight_format="fp8", tokens_per_second=3000.0),
        GroupInput("a100-idle", 1, 1, 1.5, accelerator="a100", tokens_per_second=0.0),  # pays, makes nothing
    ]
    result = rebalance(inputs, None, 0.0, RebalanceConfig(reference_accelerator="b200"))
    timer.export_economics("ns-econ", "job-econ", result)

    def value(name: str, group: str | None = None) -> float | None:
        labels = {"namespace": "ns-econ", "rljob": "job-econ"} | ({"group": group} if group else {})
        return REGISTRY.get_sample_value(f"rlfleet_operator_{name}", labels)

    assert value("group_tokens_per_second", "b200-bf16") == 2000.0
    assert value("group_cost_per_hour_usd", "b200-bf16") == 12.0  # 2 GPUs at $6
    assert value("group_usable_token_fraction", "b200-bf16") == pytest.approx(0.9, rel=1e-12)
    assert value("group_cost_per_1m_usable_tokens_usd", "b200-bf16") == pytest.approx(
        12 / 3600 / 1800 * 1e6, rel=1e-12
    )
    assert value("group_cost_per_1m_usable_tokens_usd", "h100-fp8") == pytest.approx(
        8 / 3600 / 3000 * 1e6, rel=1e-12
    )
    assert value("group_cost_per_1m_usable_tokens_usd", "a100-idle") is None  # no usable token: no price
    # the fleet: $12 + $8 + $1.5 = $21.5/h over 1800 + 3000 = 4800 usable of 5000 tok/s; the reference:
    # $6/GPU-h over 1000 tok/s per GPU, 10% out of range
    assert value("job_tokens_per_second") == 5000.0
    assert value("job_cost_per_hour_usd") == 21.5
    assert value("job_usable_token_fraction") == pytest.approx(0.96, rel=1e-12)
    assert value("job_cost_per_1m_usable_tokens_usd") == pytest.approx(21.5 / 3600 / 4800 * 1e6, rel=1e-12)
    assert value("job_reference_cost_per_1m_usable_tokens_usd") == pytest.approx(
        6 / 3600 / 900 * 1e6, rel=1e-12
    )
    assert value("job_saving_ratio") == pytest.approx(0.328125, rel=1e-12)  # 1 - (21.5/4800) / (6/900)
    assert value("job_reference_estimated") == 0.0  # measured on the b200-bf16 group

    # a group gone from the job loses its label sets; a deleted job loses all
    timer.export_economics("ns-econ", "job-econ", rebalance(inputs[1:], None, 0.0, RebalanceConfig()))
    assert (
        value("group_cost_per_hour_usd", "b200-bf16") is None
        and value("group_cost_per_hour_usd", "h100-fp8") == 8.0
    )
    assert value("job_saving_ratio") is None  # no b200 group and no configured estimate: no reference
    assert value("job_reference_estimated") is None
    assert value("job_cost_per_1m_usable_tokens_usd") == pytest.approx(9.5 / 3600 / 3000 * 1e6, rel=1e-12)
    timer.forget("ns-econ", "job-econ")
    assert value("group_tokens_per_second", "b200-bf16") is None and value("job_tokens_per_second") is None


def test_the_default_reference_is_estimated_from_the_catalogs_ratios_and_says_so() -> None:
    """No group of the trainer's class (b200) at bf16 and no named figure: the operator's config carries the
    catalog, the reference's tokens/s per GPU are the groups' through the catalog's decode-throughput ratios
    (memory bandwidth 8 TB/s b200, 3.35 h100, 2.039 a100; fp8 reads half bf16's bytes), the status and the
    gauge say it is an estimate."""
    from prometheus_client import REGISTRY

    job = RLJob.from_manifest(JOB)
    config = decide.job_config(job, get_catalog())
    assert config.catalog is get_catalog() and config.reference_accelerator == "b200"
    inputs = [
        decide.group_input(
            job,
            samplergroup(
                "h100-fp8", {"readyReplicas": 2}, accelerator="h100", replicas=2, weightFormat="fp8"
            ),
            {},
            {"oor_fraction": 0.0},
            1000.0,
        ),
        decide.group_input(
            job,
            samplergroup("a100-bf16", {"readyReplicas": 1}, accelerator="a100", replicas=1, tensorParallel=2),
            {},
            {"oor_fraction": 0.1},
            400.0,
        ),
    ]
    result = rebalance(inputs, None, 0.0, config)
    # on b200 at bf16: 1000 x (8/3.35) / 2 on the h100s' 2 GPUs, 400 x 8 / 2.039 on the a100s' 2
    per_gpu = (1000 * 8 / 3.35 / 2 + 400 * 8 / 2.039) / 4  # 690.86 tok/s
    # the fleet: 2 x $2.99 + 2 x $1.79 = $9.56/h over 1000 + 360 usable tok/s; the reference: $5.99 per GPU-h
    assert timer.fleet_costs(result) == {
        "costPer1MTokens": round(9.56 / 3600 / 1360 * 1e6, 4),
        "baselineCostPer1MTokens": round(5.99 / 3600 / per_gpu * 1e6, 4),
        "savingPercent": round(100 * (1 - (9.56 / 1360) / (5.99 / per_gpu)), 2),
        "baselineSource": "b200 bf16 estimated from catalog throughput ratios",
    }
    assert timer.fleet_costs(result)["savingPercent"] == 18.93
    timer.export_economics("ns-est", "job-est", result)
    assert (
        REGISTRY.get_sample_value(
            "rlfleet_operator_job_reference_estimated", {"namespace": "ns-est", "rljob": "job-est"}
        )
        == 1.0
    )
    timer.forget("ns-est", "job-est")


def test_the_rljob_names_the_reference_fleet_and_its_figures_win_over_the_measured_ones() -> None:
    import copy

    from pydantic import ValidationError

    named = copy.deepcopy(JOB)
    named["spec"]["router"] = {
        "reference": {"accelerator": "h200", "tokensPerGpuSecond": 1500, "oorFraction": 0.1}
    }
    config = decide.job_config(RLJob.from_manifest(named), get_catalog())
    assert (config.reference_accelerator, config.reference_price_per_gpu_hour) == (
        "h200",
        3.79,
    )  # the catalog's h200
    assert (config.reference_tokens_per_gpu_second, config.reference_oor_fraction) == (1500.0, 0.1)
    inputs = [
        GroupInput("h200-bf16", 1, 1, 3.79, accelerator="h200", tokens_per_second=900.0, oor_fraction=0.0),
        GroupInput("h100-fp8", 1, 2, 2.99, accelerator="h100", weight_format="fp8", tokens_per_second=3000.0),
    ]
    costs = timer.fleet_costs(rebalance(inputs, None, 0.0, config))
    # reference: $3.79 over 1500 x 0.9 = 1350 usable tok/s per GPU (not the h200-bf16 group's 900);
    # fleet: $3.79 + $5.98 = $9.77/h over 3900 usable tok/s
    assert costs["baselineCostPer1MTokens"] == round(3.79 / 3600 / 1350 * 1e6, 4)
    assert costs["savingPercent"] == round(100 * (1 - (9.77 / 3900) / (3.79 / 1350)), 2)  # 10.77
    assert costs["savingPercent"] == 10.77
    priced = copy.deepcopy(named)
    priced["spec"]["router"]["reference"]["costPerGpuHour"] = 4.5
    assert decide.job_config(RLJob.from_manifest(priced), get_catalog()).reference_price_per_gpu_hour == 4.5

    for bad, message in (("nope", "unknown accelerator 'nope'"), ("cpu", None)):
        wrong = copy.deepcopy(JOB)
        wrong["spec"]["router"] = {"reference": {"accelerator": bad}}
        if message is None:  # a class that runs bf16 is a valid reference
            assert decide.job_config(RLJob.from_manifest(wrong), get_catalog()).reference_accelerator == "cpu"
            continue
        with pytest.raises(ValidationError, match=message):
            RLJob.from_manifest(wrong)
