"""Against the real control plane: the fleet-mix optimizer (`spec.router.optimize`) scales SamplerGroups
through their scale subresource to a hand-computed optimum, one bounded step per rebalance interval,
never writing the RLJob's spec; an infeasible demand changes nothing and the status says why.

Sampler pods are kwok fakes, so throughput comes from `spec.router.prometheusUrl`, served by
tests/support/fake_prometheus.py: each group makes its per-replica rate times its ready replicas
(b200-nvfp4 4000 tok/s per replica at the catalog's $5.99/h, a100-bf16 1000 at $1.79/h). Demand 13000
usable tok/s, bounds b200 [0, 3], a100 [0, 4], one replica per step. By hand: b200 x3 + a100 x1 ($19.76/h)
is the only plan; from the RLJob's (1, 1) no plan within one step reaches the demand (2 x 4000 + 2 x 1000
= 10000), so b200 steps 1 -> 2 (Stepping), then 2 -> 3 (Scaled, the optimum), then stays (Kept).
"""

from __future__ import annotations

import functools
import json

import pytest
import yaml
from support import waits
from support.control_plane import events, operator_in_process, optimized_rljob
from support.fake_prometheus import fake_prometheus

wait_for = functools.partial(waits.wait_for, timeout=180.0, interval=1.0)

JOB = "fleet"
PER_REPLICA = {f"{JOB}-b200-nvfp4": 4000.0, f"{JOB}-a100-bf16": 1000.0}

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def manifest(prometheus_url: str, demand: float) -> dict:
    return optimized_rljob(JOB, prometheus_url, demand, {"b200-nvfp4": 3, "a100-bf16": 4}, maxStepReplicas=1)


def test_the_optimizer_scales_groups_to_the_optimum_through_scale_and_an_infeasible_demand_changes_nothing(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def get(kind: str, name: str) -> dict:
        return kube.get_json(kind, name, "-n", namespace)

    def rate(samplergroup: str) -> float:  # per replica x ready replicas, as the SamplerGroup's status says
        ready = get("samplergroup", samplergroup).get("status", {}).get("readyReplicas") or 0
        return PER_REPLICA.get(samplergroup, 0.0) * ready

    def replicas() -> tuple[int, int]:
        return tuple(
            get("samplergroup", f"{JOB}-{g}")["spec"]["replicas"] for g in ("b200-nvfp4", "a100-bf16")
        )

    def fleet_scaled() -> list[tuple[str, str]]:
        return sorted(
            (e["involvedObject"]["name"], e["message"].split(":")[0])
            for e in events(kube, namespace, "FleetScaled")
        )

    with fake_prometheus(rate) as (url, _), operator_in_process(kube, namespace, monkeypatch):
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest(url, 13000)))
        generation = wait_for("the RLJob", lambda: get("rljob", JOB)["metadata"].get("generation"))

        def settled() -> dict | None:
            plan = get("rljob", JOB).get("status", {}).get("fleetPlan") or {}
            return plan if plan.get("decision") == "Kept" and replicas() == (3, 1) else None

        plan = wait_for("the optimum, kept", settled, timeout=240)
        assert plan["replicas"] == {"b200-nvfp4": 3, "a100-bf16": 1}
        assert plan["costPerHour"] == 19.76  # 3 x $5.99 + $1.79
        assert plan["costPer1MUsableTokens"] == round(19.76 / 3600 / 13000 * 1e6, 4)  # 0.4222
        assert [b.split(":")[0] for b in plan["binding"]] == ["usable tokens/s >= 13000"]
        assert plan["reason"].startswith("the current replicas are the optimum")
        # one replica per interval: a step (the demand out of reach within one), then the optimum
        assert fleet_scaled() == [
            (f"{JOB}-b200-nvfp4", "replicas 1 -> 2 (Stepping)"),
            (f"{JOB}-b200-nvfp4", "replicas 2 -> 3 (Scaled)"),
        ]
        b200 = json.loads(
            kube.kubectl(
                "get",
                "samplergroup",
                f"{JOB}-b200-nvfp4",
                "-n",
                namespace,
                "-o",
                "json",
                "--show-managed-fields",
            ).stdout
        )
        assert any(m.get("subresource") == "scale" for m in b200["metadata"]["managedFields"]), b200[
            "metadata"
        ]
        assert get("deployment", f"{JOB}-b200-nvfp4")["spec"]["replicas"] == 3
        # the Git-managed spec is never written
        job = get("rljob", JOB)
        assert job["metadata"]["generation"] == generation
        assert [g["replicas"] for g in job["spec"]["samplerGroups"]] == [1, 1]
        # the pushed shares are the plan's (12000 : 1000 tok/s), each move bounded by maxShareChange
        share = get("samplergroup", f"{JOB}-b200-nvfp4")["status"]["shareHistory"][-1]
        assert share["reason"].startswith("fleet plan 0.923")

        # A demand no plan meets (the groups make at most 16000 at their bounds): nothing changes, and
        # the status says why. The RLJob's own change keeps the scale override (its replicas did not change).
        kube.kubectl(
            "apply", "-n", namespace, "--server-side", "-f", "-", input=yaml.safe_dump(manifest(url, 20000))
        )
        plan = wait_for(
            "the infeasible plan",
            lambda: (
                (p := get("rljob", JOB)["status"].get("fleetPlan", {})).get("decision") == "Infeasible" and p
            ),
        )
        assert plan["reason"].startswith("no plan meets the budgets: demand 20000 usable tokens/s"), plan
        assert plan["replicas"] == {"b200-nvfp4": 3, "a100-bf16": 1} and replicas() == (3, 1)
        assert len(fleet_scaled()) == 2
        assert [g["replicas"] for g in get("rljob", JOB)["spec"]["samplerGroups"]] == [1, 1]
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
