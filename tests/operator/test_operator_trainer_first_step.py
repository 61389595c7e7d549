"""The operator reads the trainer's report from the first step (issue 39 item 8).

On the real node the CPU example's RLJob once never showed a step, reward or KL although the operator's
tick ran: the report was read only when shares were due, the first time one full rebalance interval after
the job was first seen. Now every tick reads it (operator/rebalancer.py `rebalance_job`).

Real parts: the trainer's own exporter (trainer/metrics.py `PrometheusExporter`, a real HTTP server on
the trainer metrics port, on a loopback address of its own as a pod has its IP), the operator's pod view
of the trainer pod (operator/pods.py), its scrape and parser and the pure status function."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_operator_handlers import NS, rljob, samplergroup

from rlfleet.operator import naming as n
from rlfleet.operator import rebalancer
from rlfleet.operator.pods import pod_view
from rlfleet.operator.trainer_report import trainer_job_status
from rlfleet.trainer.metrics import PrometheusExporter

POD_IP = (
    "127.0.0.39"  # the trainer pod's address (a loopback address of its own: port 9500 stays free elsewhere)
)
NOW = "2026-12-06T20:00:00Z"


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    served = PrometheusExporter(port=n.TRAINER_METRICS_PORT, addr=POD_IP)
    yield served
    served.close()
    rebalancer.forget(NS, "j")


def trainer_pod() -> dict[str, Any]:
    return pod_view(
        {
            "metadata": {
                "name": f"{n.trainer_name('j')}-0",
                "namespace": NS,
                "labels": {n.LABEL_JOB: "j", n.LABEL_COMPONENT: "trainer"},
            },
            "status": {
                "phase": "Running",
                "podIP": POD_IP,
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )


async def test_the_first_tick_after_the_first_step_reads_the_report(exporter: PrometheusExporter) -> None:
    job = rljob(groups=("a",))
    groups = [samplergroup("a", job, {"share": 1.0, "readyReplicas": 1})]
    pods = {"trainer": [trainer_pod()]}

    def pods_of(component: str, owner: str) -> list[dict[str, Any]]:
        return pods.get(component, []) if owner == "j" else []

    exporter.update(1, {"reward_mean": 0.25, "kl_k3": 0.0125, "weight_version": 1.0})
    # the job's first tick: its first decision (none before it) ...
    decided = await rebalancer.rebalance_job(job, NS, groups, pods_of, now=1000.0)
    assert decided is not None and decided.time == 1000.0
    report = rebalancer.observed(job).report
    assert report is not None and (report.step, report.weight_version) == (1, 1)
    status = trainer_job_status(job, groups, report, NOW).status
    assert (status["step"], status["metrics"]) == (1, {"reward": 0.25, "kl": 0.0125, "updatedAt": NOW})

    # ... and every tick after it, however far from the next rebalance
    exporter.update(2, {"reward_mean": 0.5, "kl_k3": 0.025, "weight_version": 2.0})
    assert await rebalancer.rebalance_job(job, NS, groups, pods_of, now=1005.0) is None
    assert rebalancer.observed(job).report.step == 2  # type: ignore[union-attr]

    # a trainer that cannot be read this tick leaves no report (the status keeps what it showed)
    pods["trainer"] = []
    assert await rebalancer.rebalance_job(job, NS, groups, pods_of, now=1010.0) is None
    assert rebalancer.observed(job).report is None
