"""The real-node tier (`-m node`): pods that really run, on the dev cluster's real node (docs/dev-cluster.md).

`dev_cluster` (session scope) starts the control plane with the real node (tests/cluster/realnode.py) in
a scratch directory, builds the images (tests/cluster/nodeimages.py; cached per input digest in
~/.cache/rlfleet/images) and loads them into the node. Set RLFLEET_DEV_CLUSTER_WORKDIR=<dir of a
`scripts/dev-cluster up`> to reuse a running one (its images must be loaded: `scripts/dev-cluster images`).
RLFLEET_DEV_CLUSTER_IMAGES=<names> builds and loads only those rlfleet images ("" none: a module that
needs none of them, e.g. test_node_sandbox.py, skips their rebuild after every source edit).

The tier needs root and the node's Debian packages (which it installs as root). On a machine that cannot
run containers at all it is skipped with the reason; never on this project's machines (CI runs as root).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

import controlplane  # noqa: E402 - tests/cluster, put on sys.path just above
import nodeimages  # noqa: E402
import realnode  # noqa: E402


@dataclass
class DevCluster:
    kube: Any  # controlplane.KubeCluster
    node: Any  # realnode.RealNode
    images: dict[str, Any]  # name -> nodeimages.Built
    plane: Any | None  # controlplane.ControlPlane (None when attached to a running one)


# The one node test that stops the session's cluster (test_node_pods.py): it must run after every other node
# test, whichever module each is in (a module sorting after test_node_pods.py found the cluster gone).
STOPS_THE_CLUSTER = "test_down_leaves_no_process_mount_bridge_or_iptables_rule"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    stop = [i for i in items if i.name == STOPS_THE_CLUSTER]
    if stop:
        rest = [i for i in items if i.name != STOPS_THE_CLUSTER]
        after = max(k for k, i in enumerate(rest) if "node" in i.keywords) + 1
        items[:] = rest[:after] + stop + rest[after:]
    problems = realnode.host_problems()
    if not problems:
        return
    skip = pytest.mark.skip(reason=f"this machine cannot run containers: {'; '.join(problems)}")
    for item in items:
        if "node" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ns(dev_cluster: DevCluster) -> Iterator[str]:
    """A fresh namespace on the dev cluster for one test (support/control_plane.py); deleted afterwards."""
    from support.control_plane import fresh_namespace

    with fresh_namespace(dev_cluster.kube, "n", ready_s=60) as name:
        yield name


@pytest.fixture(scope="session")
def dev_cluster() -> Iterator[DevCluster]:
    log = lambda msg: print(f"[dev-cluster] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    attach = os.environ.get("RLFLEET_DEV_CLUSTER_WORKDIR")
    # RLFLEET_DEV_CLUSTER_IMAGES: the rlfleet images to build and load (comma-separated; default all three).
    # Empty for a module that runs none of them (test_node_sandbox.py): no rebuild after every source edit.
    names = os.environ.get("RLFLEET_DEV_CLUSTER_IMAGES", "operator,sampler,trainer")
    built = {b.name: b for b in nodeimages.build_all([n for n in names.split(",") if n.strip()], log=log)}
    if attach:
        workdir = Path(attach)
        yield DevCluster(
            controlplane.KubeCluster.from_state(workdir), realnode.RealNode(workdir, log), built, None
        )
        return
    workdir = controlplane.scratch_dir("rlfleet-dev-")
    plane = controlplane.ControlPlane(workdir, log=log, real_node=True)
    try:
        cluster = plane.start()
        plane.node.load_images(list(built.values()))
        log(f"started in {cluster.start_seconds:.1f}s at {cluster.server}")
        yield DevCluster(cluster, plane.node, built, plane)
    finally:
        try:
            plane.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
