"""Spot groups on the test fleet (docs/scheduling.md "Spot groups"): the real kube-scheduler places a
`spot: true` group's pods on the spot node only, though the on-demand H100 nodes have room, and an
on-demand group's never there. The spot node is one more kwok node: an H100 of a GKE spot pool (GFD
product label, `cloud.google.com/gke-spot: "true"` and its NoSchedule taint, the GPU taint)."""

from __future__ import annotations

import pytest
from support.control_plane import get, operator_in_process, spot_h100_node
from support.manifests import samplergroup
from support.waits import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.usefixtures("crds")]

SPOT_NODE = "gpu-h100-spot"


def test_a_spot_group_lands_on_the_spot_node_and_an_on_demand_group_never_does(
    kube, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube.apply(spot_h100_node(SPOT_NODE))
    try:
        with operator_in_process(kube, namespace, monkeypatch):
            kube.apply(
                *(
                    samplergroup(name, name=name, weightFormat="fp8", replicas=3, spot=spot)
                    for name, spot in (("spot", True), ("ondemand", False))
                ),
                namespace=namespace,
            )

            def placed() -> dict[str, list[str]] | None:
                pods = get(kube, namespace, "pods")["items"]
                if len(pods) != 6 or not all(
                    p["status"].get("phase") == "Running" and p["spec"].get("nodeName") for p in pods
                ):
                    return None
                nodes: dict[str, list[str]] = {}
                for p in pods:
                    nodes.setdefault(p["metadata"]["labels"]["rlfleet.dev/group"], []).append(
                        p["spec"]["nodeName"]
                    )
                return nodes

            nodes = wait_for("the 6 sampler pods running", placed, timeout=120)
            assert nodes["spot"] == [SPOT_NODE] * 3, nodes
            assert all(node in ("gpu-h100-0", "gpu-h100-1") for node in nodes["ondemand"]), nodes
            assert get(kube, namespace, "samplergroup", "spot")["spec"]["spot"] is True
    finally:
        kube.kubectl("delete", "node", SPOT_NODE, "--wait=false", check=False)
