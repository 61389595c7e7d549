"""Against the real control plane: a group the fleet-mix optimizer scaled to 0 replicas comes back after an
operator restart. A group at 0 replicas is never measured, and the operator's memory of its tokens/s per
replica dies with the process: the figure is kept in the RLJob's `status.decisions` and the
restarted operator goes on from it (operator/decide.py), and RLJob `status.fleetPlan.throughput` says
which figure the group was planned at.

The operator runs as `rlfleet operator run` subprocesses, the first one killed (SIGKILL) and a second one
started: a real restart. Sampler pods are kwok fakes, so throughput comes from `spec.router.prometheusUrl`
(tests/support/fake_prometheus.py): b200-nvfp4 4000 tok/s per ready replica, a100-bf16 1000 before the
restart and 0 after it (so the figure the second operator plans with can only be the restored one). Bounds
b200 [0, 1], a100 [0, 1]. Demand 5000: b200 x1 + a100 x1 is the only plan; demand 4000: b200 x1 alone ($5.99/h
against $7.78/h, beyond the 5% hysteresis), so a100 goes 1 -> 0.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import pytest
import yaml
from support import waits
from support.control_plane import events, optimized_rljob
from support.fake_prometheus import fake_prometheus
from support.processes import start_operator

wait_for = functools.partial(waits.wait_for, timeout=240.0, interval=1.0)

JOB = "comeback"
B200, A100 = f"{JOB}-b200-nvfp4", f"{JOB}-a100-bf16"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def manifest(prometheus_url: str, demand: float) -> dict:
    return optimized_rljob(JOB, prometheus_url, demand, {"b200-nvfp4": 1, "a100-bf16": 1})


def test_a_group_scaled_to_zero_comes_back_after_an_operator_restart_from_its_persisted_figure(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    def get(kind: str, name: str) -> dict:
        return kube.get_json(kind, name, "-n", namespace)

    per_replica = {B200: 4000.0, A100: 1000.0}

    def rate(samplergroup: str) -> float:  # per replica x ready replicas, as the SamplerGroup's status says
        ready = get("samplergroup", samplergroup).get("status", {}).get("readyReplicas") or 0
        return per_replica.get(samplergroup, 0.0) * ready

    def apply(body: dict) -> None:
        kube.kubectl("apply", "-n", namespace, "--server-side", "-f", "-", input=yaml.safe_dump(body))

    def steady(group: str) -> dict | None:
        """The group's steady figure in the RLJob's status.decisions (operator/decide.py)."""
        groups = (get("rljob", JOB).get("status", {}).get("decisions") or {}).get("groups") or []
        return next((g.get("memory", {}).get("steadyThroughput") for g in groups if g["name"] == group), None)

    def plan() -> dict:
        return get("rljob", JOB).get("status", {}).get("fleetPlan") or {}

    def fleet_scaled(group: str) -> list[str]:
        return sorted(
            e["message"].split(":")[0]
            for e in events(kube, namespace, "FleetScaled")
            if e["involvedObject"]["name"] == group
        )

    first_log, second_log = tmp_path / "operator-1.log", tmp_path / "operator-2.log"
    with fake_prometheus(rate) as (url, _):
        operator = start_operator(kube, namespace, first_log, "--standalone")
        try:
            apply(manifest(url, 5000))
            # a100 is measured at 1 replica (steady over the Prometheus window) and kept: the plan needs it
            figure = wait_for("a100's steady figure in the decisions", lambda: steady("a100-bf16"))
            assert {k: figure[k] for k in ("tokensPerSecondPerReplica", "replicas", "weightFormat")} == {
                "tokensPerSecondPerReplica": 1000.0,
                "replicas": 1,
                "weightFormat": "bf16",
            }
            # the demand falls: a100 goes to 0 and its figure stays in the decisions
            apply(manifest(url, 4000))
            wait_for(
                "a100 at 0 replicas",
                lambda: (
                    get("samplergroup", A100)["spec"]["replicas"] == 0
                    and (get("samplergroup", A100).get("status", {}).get("readyReplicas") or 0) == 0
                ),
            )
            assert fleet_scaled(A100) == ["replicas 1 -> 0 (Scaled)"]
            assert steady("a100-bf16") == figure
        finally:
            os.killpg(operator.pid, signal.SIGKILL)
            operator.wait(10)

        # The restart: the new process knows nothing of a100 but the RLJob's status.decisions; a100 makes nothing from now on,
        # so the figure the optimizer plans it at can only be the restored one.
        per_replica[A100] = 0.0
        apply(manifest(url, 5000))
        operator = start_operator(kube, namespace, second_log, "--standalone")
        try:
            back = wait_for(
                "a100 back at 1 replica, kept",
                lambda: (
                    (p := plan()).get("decision") == "Kept"
                    and p["replicas"] == {"b200-nvfp4": 1, "a100-bf16": 1}
                    and p
                ),
            )
            assert get("samplergroup", A100)["spec"]["replicas"] == 1
            assert fleet_scaled(A100) == ["replicas 0 -> 1 (Scaled)", "replicas 1 -> 0 (Scaled)"]
            assert back["throughput"]["a100-bf16"] == {
                "tokensPerSecondPerReplica": 1000.0,
                "basis": "measured",
                "detail": f"steady reading over 1 replica(s) at bf16, {figure['measuredAt']}",
            }
            assert back["throughput"]["b200-nvfp4"]["basis"] == "measured"
            assert steady("a100-bf16") == figure
            kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
        finally:
            os.killpg(operator.pid, signal.SIGKILL)
            operator.wait(10)
    for log in (first_log, second_log):
        assert "Traceback" not in log.read_text(), log.read_text()
