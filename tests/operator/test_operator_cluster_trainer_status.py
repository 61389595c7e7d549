"""Against the real control plane: the trainer has no API rights, so the operator's rebalance tick scrapes
and the RLJob's status pipeline writes what the trainer EXPORTS (step, weight version, metrics, the collapse detector's state) into the RLJob
status, raises CollapseRisk with an Event, and quarantines the group the detector named
(`safety.action: quarantine-group`).

The trainer's exporter is the real `rlfleet.trainer.metrics.PrometheusExporter` on 127.0.0.1 (free
port). The trainer pod itself is a kwok fake (Running + Ready, but no process behind its pod IP), so the
one thing replaced is the pod's address: `rebalancer.trainer_metrics_url(pod)` is pointed at the
local exporter (the operator runs in this process via KopfRunner), after checking it is asked for
trainer pod 0 — the same approach as tests/router/test_router_timer_cluster.py's local Prometheus.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator

import pytest
import yaml
from support import waits
from support.control_plane import operator_in_process, rljob

from rlfleet.operator import rebalancer
from rlfleet.trainer.collapse import Alert
from rlfleet.trainer.metrics import PrometheusExporter

# these tests wait on rebalance intervals: longer timeout, coarser polling than the default
wait_for = functools.partial(waits.wait_for, timeout=120.0, interval=1.0)

JOB = "tstat"

pytestmark = pytest.mark.cluster  # ~30 s: runs with -m "not slow"


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exp = PrometheusExporter(port=0)  # 127.0.0.1
    yield exp
    exp.close()


def manifest() -> dict:
    return rljob(
        JOB,
        router={"policy": "throughput", "rebalanceIntervalSeconds": 5},
        safety={"action": "quarantine-group"},
    )


def test_operator_writes_trainer_status_collapse_risk_and_quarantines(
    kube, crds, namespace: str, exporter: PrometheusExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def local_exporter(pod: dict) -> str:  # `pod` is the operator's view of the pod (its pod index)
        asked.append(pod["name"])
        assert pod["podIP"]  # a ready trainer pod of the job
        return f"http://127.0.0.1:{exporter.port}/metrics"

    monkeypatch.setattr(rebalancer, "trainer_metrics_url", local_exporter)
    exporter.update(
        12,
        {
            "reward_mean": 0.42,
            "kl_k3": 0.031,
            "oor_fraction": 0.07,
            "entropy": 1.5,
            "sc_tail_ratio": 1.3,
            "weight_version": 11.0,
            "group/b200-nvfp4/kl_k3": 0.2,
        },
    )
    exporter.update_collapse([], [], pause=False)

    def job() -> dict:
        return kube.get_json("rljob", JOB, "-n", namespace)

    def sg(name: str) -> dict:
        return kube.get_json("samplergroup", f"{JOB}-{name}", "-n", namespace)

    def risk() -> dict:
        return next(c for c in job()["status"]["conditions"] if c["type"] == "CollapseRisk")

    with operator_in_process(kube, namespace, monkeypatch):
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest()))
        status = wait_for(
            "step and metrics from the exporter",
            lambda: (s := job().get("status", {})).get("step") == 12 and s,
        )
        assert status["metrics"]["reward"] == 0.42 and status["metrics"]["kl"] == 0.031
        assert status["metrics"]["oorFraction"] == 0.07 and status["metrics"]["updatedAt"]
        assert status["weightVersion"] >= 11
        assert risk()["status"] == "False" and risk()["reason"] == "NoSignal"
        assert set(asked) == {f"{JOB}-trainer-0"}

        # the detector fires on one group and quarantines it
        alert = Alert(step=13, signal="kl_surge", value=0.2, baseline=0.01, group="b200-nvfp4")
        exporter.update(13, {"kl_k3": 0.09, "weight_version": 12.0})
        exporter.update_collapse([alert], ["b200-nvfp4"], pause=False)
        wait_for("CollapseRisk", lambda: risk()["status"] == "True", timeout=60)
        cond = risk()
        assert cond["reason"] == "KlSurge" and "kl_surge (group b200-nvfp4)" in cond["message"]
        assert cond["observedGeneration"] == job()["metadata"]["generation"]
        assert job()["status"]["step"] == 13 and job()["status"]["weightVersion"] >= 12
        wait_for(
            "quarantine",
            lambda: (
                sg("b200-nvfp4")["status"].get("quarantined") is True
                and sg("b200-nvfp4")["status"].get("share") == 0.0
            ),
            timeout=60,
        )
        assert sg("a100-bf16")["status"].get("quarantined") is False
        assert not sg("b200-nvfp4")["spec"].get("quarantined")  # status only; the spec stays the user's
        assert not job()["spec"]["samplerGroups"][0].get("quarantined")
        events = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        assert any(e.get("reason") == "KlSurge" and e["involvedObject"]["kind"] == "RLJob" for e in events)

        # the signal stops: CollapseRisk clears (the quarantine stays: the detector's state is cumulative)
        exporter.update_collapse([], ["b200-nvfp4"], pause=False)
        wait_for("CollapseRisk cleared", lambda: risk()["status"] == "False", timeout=60)
        assert sg("b200-nvfp4")["status"]["quarantined"] is True
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
