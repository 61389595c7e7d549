"""Against the real control plane: a SamplerGroup's replicas are written by the operator's apply only when it
creates the group; after that the scale subresource owns them (operator/replicas.py), as an HPA-scaled
Deployment's. Held here on the real kube-apiserver's server-side apply and managedFields:

- a group an older operator applied WITH its replicas (field manager rlfleet-operator, annotation
  rlfleet.dev/job-replicas) is migrated without its replicas changing: the handover manager shares them
  first (the SSA docs' "Transferring ownership"), so the apply that leaves them out does not reset them to
  the CRD's default (1);
- a new group is created at the RLJob's replicas and handed over at once;
- a `kubectl scale` is kept across a reconcile of the RLJob and an operator restart (the first
  `rlfleet operator run` killed, a second one started), and the decide stage records it (status.decisions'
  reason, read back from there by the second operator);
- the RLJob's own change of the replicas wins, at once (a Scaled Event), and the next decision says why.
"""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import waits
from support.control_plane import events, rljob
from support.processes import start_operator

from rlfleet.api import RLJob
from rlfleet.operator import builders
from rlfleet.operator.naming import FIELD_MANAGER, REPLICAS_HANDOVER_MANAGER

wait_for = functools.partial(waits.wait_for, timeout=120.0, interval=1.0)

JOB = "scaled"
FRESH, UPGRADED = f"{JOB}-b200-nvfp4", f"{JOB}-a100-bf16"  # created by this operator / by an older one
OLD_ANNOTATION = "rlfleet.dev/job-replicas"  # which RLJob value an older operator applied last
BY_HAND = "scaled on the SamplerGroup (kubectl scale) to 3, not the last decision's 1"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def manifest(fresh_replicas: int = 1, max_steps: int = 2, interval: int = 5) -> dict[str, Any]:
    return rljob(
        JOB,
        (
            {
                "name": "b200-nvfp4",
                "accelerator": "b200",
                "replicas": fresh_replicas,
                "weightFormat": "nvfp4",
            },
            {"name": "a100-bf16", "accelerator": "a100", "replicas": 2, "weightFormat": "bf16"},
        ),
        router={"rebalanceIntervalSeconds": interval},
        staleness={"maxSteps": max_steps},
    )


def test_replicas_belong_to_the_scale_subresource_after_creation_a_kubectl_scale_is_kept_the_rljobs_change_wins(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    def get(kind: str, name: str) -> dict[str, Any]:
        return kube.get_json(kind, name, "-n", namespace)

    def managed(name: str) -> dict[tuple[str, str, str], dict[str, Any]]:
        """(manager, operation, subresource) -> the spec fields it owns, from the SamplerGroup's managedFields."""
        sg = json.loads(
            kube.kubectl(
                "get", "samplergroup", name, "-n", namespace, "-o", "json", "--show-managed-fields"
            ).stdout
        )
        return {
            (m["manager"], m["operation"], m.get("subresource", "")): m.get("fieldsV1", {}).get("f:spec", {})
            for m in sg["metadata"]["managedFields"]
        }

    def handed_over(name: str) -> bool:
        owners = managed(name)
        return "f:replicas" not in owners[(FIELD_MANAGER, "Apply", "")] and any(
            "f:replicas" in fields for (manager, _, _), fields in owners.items() if manager != FIELD_MANAGER
        )

    def replicas(name: str) -> tuple[int, int]:
        return get("samplergroup", name)["spec"]["replicas"], get("deployment", name)["spec"]["replicas"]

    def apply_rljob(job: dict[str, Any]) -> None:
        kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job))

    def reconciled(
        max_steps: int,
    ) -> bool:  # the job's ConfigMap (applied by the reconcile only) has the spec
        config = yaml.safe_load(get("configmap", f"{JOB}-config")["data"]["rljob.yaml"])
        return config["spec"]["staleness"]["maxSteps"] == max_steps

    def decision(group: str) -> dict[str, Any]:
        return next(g for g in get("rljob", JOB)["status"]["decisions"]["groups"] if g["name"] == group)

    apply_rljob(manifest())
    body = get("rljob", JOB)
    # an older operator's SamplerGroup: its apply (as rlfleet-operator) owned the replicas, with the annotation
    parsed = RLJob.from_manifest(body)
    old = builders.build_samplergroup(parsed, parsed.spec.sampler_groups[1], namespace, body, replicas=2)
    old["metadata"]["annotations"] = {OLD_ANNOTATION: "2"}
    kube.kubectl(
        "apply",
        "--server-side",
        f"--field-manager={FIELD_MANAGER}",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(old),
    )
    assert "f:replicas" in managed(UPGRADED)[(FIELD_MANAGER, "Apply", "")]

    operator = start_operator(kube, namespace, tmp_path / "first.log", "--standalone")
    try:
        # migrated: applied by this operator (the annotation gone), its replicas handed over, unchanged
        wait_for(
            "the older group applied again",
            lambda: (
                OLD_ANNOTATION not in (get("samplergroup", UPGRADED)["metadata"].get("annotations") or {})
            ),
        )
        assert get("samplergroup", UPGRADED)["spec"]["replicas"] == 2  # not the CRD's default, 1
        assert (
            handed_over(UPGRADED)
            and managed(UPGRADED).get((REPLICAS_HANDOVER_MANAGER, "Apply", ""), {}).get("f:replicas") == {}
        )
        assert wait_for("the older group's Deployment", lambda: replicas(UPGRADED)) == (2, 2)
        # created at the RLJob's replicas, then handed over
        wait_for("the new group handed over", lambda: handed_over(FRESH))
        assert wait_for("the new group's Deployment", lambda: replicas(FRESH)) == (1, 1)
        wait_for("a first decision", lambda: decision("b200-nvfp4"))
        # a kubectl scale: the decide stage records it as an observation
        kube.kubectl("scale", "-n", namespace, f"samplergroup/{FRESH}", "--replicas=3")
        wait_for("the Deployment scaled by hand", lambda: replicas(FRESH) == (3, 3))
        by_hand = wait_for(
            "the manual scale decided",
            lambda: (r := decision("b200-nvfp4"))["replicasReason"].startswith(BY_HAND) and r,
        )
        assert (by_hand["replicas"], by_hand["jobReplicas"]) == (3, 1)
        # a reconcile of the RLJob (another field of its spec) keeps it
        apply_rljob(manifest(max_steps=3))
        wait_for("the RLJob reconciled", lambda: reconciled(3))
        assert replicas(FRESH) == (3, 3) and replicas(UPGRADED) == (2, 2)
        decided_at = get("rljob", JOB)["status"]["decisions"]["time"]
    finally:
        os.killpg(operator.pid, signal.SIGKILL)
        operator.wait(10)

    # the operator gone; the RLJob changes meanwhile, so that the second one reconciles it (an update)
    apply_rljob(manifest(max_steps=4))
    operator = start_operator(kube, namespace, tmp_path / "second.log", "--standalone")
    try:
        wait_for("the RLJob reconciled after the restart", lambda: reconciled(4))
        assert replicas(FRESH) == (3, 3) and replicas(UPGRADED) == (2, 2)
        wait_for(
            "a decision after the restart",
            lambda: get("rljob", JOB)["status"]["decisions"]["time"] > decided_at,
        )
        assert decision("b200-nvfp4")["replicasReason"].startswith(BY_HAND)  # read back from status, kept
        assert replicas(FRESH) == (3, 3)
        # the RLJob's own change wins, at once: by its reconcile (no decision is due for an hour: the act
        # stage cannot have scaled it), and the next decision says why
        apply_rljob(manifest(fresh_replicas=2, max_steps=4, interval=3600))
        wait_for("the RLJob's replicas", lambda: replicas(FRESH) == (2, 2))
        scaled = wait_for(
            "the Scaled Event",
            lambda: [
                e["message"]
                for e in events(kube, namespace, "Scaled")
                if e["involvedObject"]["name"] == FRESH
            ],
        )
        assert scaled == ["replicas 3 -> 2: the RLJob's samplerGroups[].replicas changed: 1 -> 2"]
        apply_rljob(manifest(fresh_replicas=2, max_steps=4))
        changed = wait_for(
            "the change decided",
            lambda: (r := decision("b200-nvfp4"))["replicasReason"].startswith("the RLJob's") and r,
        )
        assert (changed["replicas"], changed["jobReplicas"], changed["replicasReason"]) == (
            2,
            2,
            "the RLJob's samplerGroups[].replicas changed: 1 -> 2",
        )
        assert replicas(UPGRADED) == (2, 2)
    finally:
        os.killpg(operator.pid, signal.SIGKILL)
        operator.wait(10)
    for log in ("first.log", "second.log"):
        assert "Traceback" not in (tmp_path / log).read_text(), (tmp_path / log).read_text()
