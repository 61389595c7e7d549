"""Against the real control plane: the precision autopilot (`spec.router.autopilot`) moves a group whose
reported mismatch is made worse up nvfp4 -> fp8 -> bf16 on its SamplerGroup (Events, the RLJob's
status and its decisions), then quarantines it at the top; the RLJob's spec is never written, its own changes keep the
override, and a new weightFormat in the RLJob ends it. With `stepDown`, a group made worse and then
better steps up, back down after its cool-down, and up again with the cool-down doubled when it
breaches at the cheaper format. A group answering invalid tokens is quarantined at its format (issue 39
item 7) and `kubectl get sg` shows its Usable share.

The trainer's exporter is the real `PrometheusExporter` on 127.0.0.1; the trainer pod is a kwok fake, so
the operator's `rebalancer.trainer_metrics_url` is pointed at the exporter (as in
tests/operator/test_operator_cluster_trainer_status.py)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator

import pytest
import yaml
from support import waits
from support.control_plane import operator_in_process, rljob

from rlfleet.operator import naming as n
from rlfleet.operator import rebalancer
from rlfleet.trainer.metrics import PrometheusExporter

wait_for = functools.partial(waits.wait_for, timeout=120.0, interval=1.0)

JOB = "autop"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def exporter() -> Iterator[PrometheusExporter]:
    exp = PrometheusExporter(port=0)  # 127.0.0.1
    yield exp
    exp.close()


def prepare(
    kube, namespace: str, exporter: PrometheusExporter, monkeypatch: pytest.MonkeyPatch
) -> Callable[[str, str], dict]:
    """The trainer's metrics read from `exporter`; returns `get(kind, name)` of the namespace's objects as JSON."""
    monkeypatch.setattr(
        rebalancer, "trainer_metrics_url", lambda pod: f"http://127.0.0.1:{exporter.port}/metrics"
    )

    def get(kind: str, name: str) -> dict:
        return kube.get_json(kind, name, "-n", namespace)

    return get


def decision(get: Callable[[str, str], dict], group: str) -> dict:
    """The group's decision in the RLJob's status.decisions (operator/decide.py; {} before the first)."""
    groups = (get("rljob", JOB).get("status", {}).get("decisions") or {}).get("groups") or []
    return next((g for g in groups if g["name"] == group), {})


def manifest(weight_format: str = "nvfp4", max_share_change: float = 0.1, **autopilot: object) -> dict:
    return rljob(
        JOB,
        [  # the 0-replica groups make the channel publish the fp8 and bf16 views
            {"name": "fast", "accelerator": "b200", "replicas": 1, "weightFormat": weight_format},
            {"name": "spare-fp8", "accelerator": "b200", "replicas": 0, "weightFormat": "fp8"},
            {"name": "spare-bf16", "accelerator": "b200", "replicas": 0, "weightFormat": "bf16"},
        ],
        router={
            "rebalanceIntervalSeconds": 5,
            "maxShareChange": max_share_change,
            "autopilot": {"enabled": True, "patience": 1, **autopilot},
            "optimize": {"budgets": {"groupMaxKl": 0.01}},
        },
    )


def test_a_group_made_worse_steps_up_then_is_quarantined_and_the_rljob_keeps_or_ends_the_override(
    kube, crds, namespace: str, exporter: PrometheusExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    get = prepare(kube, namespace, exporter, monkeypatch)

    def fast() -> dict:
        return get("samplergroup", f"{JOB}-fast")

    def events(reason: str) -> list[str]:
        items = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        return [
            e["message"]
            for e in items
            if e.get("reason") == reason and e["involvedObject"]["name"] == f"{JOB}-fast"
        ]

    def apply(body: dict) -> None:
        kube.kubectl("apply", "-n", namespace, "--server-side", "-f", "-", input=yaml.safe_dump(body))

    with operator_in_process(kube, namespace, monkeypatch):
        exporter.update(1, {"kl_k3": 0.004, "group/fast/kl_k3": 0.004})  # within the budget 0.01
        apply(manifest())
        wait_for("the group's Deployment", lambda: get("deployment", f"{JOB}-fast"))
        generation = get("rljob", JOB)["metadata"]["generation"]
        exporter.update(2, {"kl_k3": 0.05, "group/fast/kl_k3": 0.05})  # made worse

        wait_for("quarantined at the top", lambda: decision(get, "fast").get("quarantined") is True)
        assert fast()["spec"]["weightFormat"] == "bf16"
        assert sorted(events("PrecisionStepped")) == [
            "KL 0.05 > 0.01 for 1 intervals: weightFormat fp8 -> bf16",
            "KL 0.05 > 0.01 for 1 intervals: weightFormat nvfp4 -> fp8",
        ]
        (quarantined,) = events("PrecisionQuarantined")
        assert quarantined.startswith("KL 0.05 > 0.01 for 1 intervals, no step up from bf16")
        status = wait_for("the status", lambda: get("rljob", JOB)["status"].get("precisionAutopilot"))
        assert status == {"fast": quarantined}
        wait_for("the group's share 0", lambda: fast()["status"].get("quarantined") is True)
        deployment = get("deployment", f"{JOB}-fast")  # the pods roll to the group's new view
        assert deployment["metadata"]["labels"][n.LABEL_WEIGHT_FORMAT] == "bf16"
        job = get("rljob", JOB)
        assert (
            job["metadata"]["generation"] == generation
            and job["spec"]["samplerGroups"][0]["weightFormat"] == "nvfp4"
        )

        # The RLJob changed elsewhere: its reconcile keeps the override (its own weightFormat did not change).
        apply(manifest(max_share_change=0.2))
        wait_for(
            "the RLJob's reconcile",
            lambda: get("rljob", JOB)["status"].get("observedGeneration") == generation + 1,
        )
        assert fast()["spec"]["weightFormat"] == "bf16"
        # A new weightFormat in the RLJob ends the override.
        apply(manifest(weight_format="fp8", max_share_change=0.2))
        wait_for("the RLJob's value", lambda: fast()["spec"]["weightFormat"] == "fp8")
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")


def test_a_group_steps_up_recovers_steps_down_breaches_and_steps_up_with_its_cool_down_doubled(
    kube, crds, namespace: str, exporter: PrometheusExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patience 1, cool-down 2 intervals (bound 8): over budget -> nvfp4 -> fp8; within it for the cool-down
    (after the one interval not judged) -> fp8 -> nvfp4, the RLJob's own format (the floor); over again
    -> nvfp4 -> fp8 with the cool-down doubled to 4."""
    get = prepare(kube, namespace, exporter, monkeypatch)

    def weight_format() -> str:
        return get("samplergroup", f"{JOB}-fast")["spec"]["weightFormat"]

    def moves() -> list[tuple[str, str]]:  # (reason, message) of the autopilot's Events, oldest first
        items = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        ours = [
            e
            for e in items
            if e.get("reason", "").startswith("Precision") and e["involvedObject"]["name"] == f"{JOB}-fast"
        ]
        return [
            (e["reason"], e["message"])
            for e in sorted(ours, key=lambda e: e.get("firstTimestamp") or e["eventTime"])
        ]

    with operator_in_process(kube, namespace, monkeypatch):
        exporter.update(1, {"kl_k3": 0.004, "group/fast/kl_k3": 0.004})  # within the budget 0.01
        kube.kubectl(
            "apply",
            "-n",
            namespace,
            "--server-side",
            "-f",
            "-",
            input=yaml.safe_dump(manifest(stepDown=True, cooldownIntervals=2, maxCooldownIntervals=8)),
        )
        wait_for("the group's Deployment", lambda: get("deployment", f"{JOB}-fast"))
        exporter.update(2, {"kl_k3": 0.05, "group/fast/kl_k3": 0.05})  # made worse
        wait_for("the step up", lambda: weight_format() == "fp8")
        exporter.update(3, {"kl_k3": 0.004, "group/fast/kl_k3": 0.004})  # recovered
        wait_for("the step down", lambda: weight_format() == "nvfp4")
        exporter.update(4, {"kl_k3": 0.05, "group/fast/kl_k3": 0.05})  # worse again at the cheaper format
        wait_for("the step up again", lambda: weight_format() == "fp8")
        exporter.update(
            5, {"kl_k3": 0.004, "group/fast/kl_k3": 0.004}
        )  # within: it stays at fp8 for 1 + 4 intervals
        doubled = (
            "KL 0.05 > 0.01 for 1 intervals after a step down: the cool-down doubles, 2 -> 4 intervals: "
            "weightFormat nvfp4 -> fp8"
        )
        assert moves() == [
            ("PrecisionStepped", "KL 0.05 > 0.01 for 1 intervals: weightFormat nvfp4 -> fp8"),
            (
                "PrecisionSteppedDown",
                "within its budget (KL 0.004 <= 0.01) for 2 intervals (the cool-down 2): "
                "weightFormat fp8 -> nvfp4; back to fp8 if over it again within the next 2 "
                "intervals, with the cool-down doubled",
            ),
            ("PrecisionStepped", doubled),
        ]
        status = wait_for(
            "the status",
            lambda: (s := get("rljob", JOB)["status"].get("precisionAutopilot")) == {"fast": doubled} and s,
        )
        assert status == {"fast": doubled}
        # the doubled cool-down is in the RLJob's status.decisions (a restarted operator goes on from there)
        wait_for(
            "the cool-down in status",
            lambda: (
                decision(get, "fast").get("memory", {}).get("precisionCooldown")
                == {"cooldownIntervals": 4, "onProbation": False}
            ),
        )
        job = get("rljob", JOB)
        assert (
            job["metadata"]["generation"] == 1 and job["spec"]["samplerGroups"][0]["weightFormat"] == "nvfp4"
        )
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")


def test_a_group_answering_invalid_tokens_is_quarantined_at_its_format_and_kubectl_shows_its_usable_share(
    kube, crds, namespace: str, exporter: PrometheusExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39 item 7: the trainer reports the group's tokens mostly invalid (trained fraction 0.25, the
    reasons by count) while its KL is within budget: the autopilot quarantines it at nvfp4 (no step up),
    the Event and the RLJob's status say the share and the top reason, and `kubectl get sg` shows Usable."""
    get = prepare(kube, namespace, exporter, monkeypatch)

    def fast() -> dict:
        return get("samplergroup", f"{JOB}-fast")

    with operator_in_process(kube, namespace, monkeypatch):
        exporter.update(
            1,
            {
                "kl_k3": 0.004,
                "group/fast/kl_k3": 0.004,
                "group/fast/oor_fraction": 0.0,
                "group/fast/trained_fraction": 0.25,
                "group/fast/sampled_tokens": 64.0,
                "group/fast/invalid_reason_logprob_not_finite_or_positive": 40.0,
                "group/fast/invalid_reason_sampled_token_not_in_support": 8.0,
            },
        )
        kube.kubectl("apply", "-n", namespace, "--server-side", "-f", "-", input=yaml.safe_dump(manifest()))
        wait_for("quarantined", lambda: decision(get, "fast").get("quarantined") is True)
        assert fast()["spec"]["weightFormat"] == "nvfp4"  # no step up: a precision does not repair garbage
        reason = (
            "invalid share 0.75 > 0.05 (top reason logprob_not_finite_or_positive: 40 tokens) for 1 intervals: "
            "quarantined (invalid answers are not a precision to step up from)"
        )
        items = json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
        assert [e["message"] for e in items if e.get("reason") == "PrecisionQuarantined"] == [reason]
        assert wait_for(
            "the RLJob's status", lambda: get("rljob", JOB)["status"].get("precisionAutopilot")
        ) == {"fast": reason}
        status = wait_for(
            "the group's figures", lambda: fast()["status"] if "usableFraction" in fast()["status"] else None
        )
        assert (status["usableFraction"], status["invalidTokens"]) == (
            0.25,
            {"logprob_not_finite_or_positive": 40, "sampled_token_not_in_support": 8},
        )
        head, row = kube.kubectl("get", "sg", f"{JOB}-fast", "-n", namespace).stdout.splitlines()[:2]
        start = head.index("USABLE")  # columns are aligned; an empty one (no reading) leaves blanks
        assert row[start:].split()[0] == "0.25" and head[start:].split()[1] == "REASON"
        kube.kubectl("delete", "rljob", JOB, "-n", namespace, "--wait=false")
