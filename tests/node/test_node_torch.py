"""The torch-backend CPU example on the real node: `helm install` of charts/rlfleet, then `kubectl apply -f
examples/rljob-cpu-torch.yaml` as users apply it (its PVC on the dev cluster's default StorageClass): a
trainer pod running torchrun with two gloo ranks, the torch backend (transformers + FSDP2) doing FULL
fine-tuning of the tiny Qwen3 (no LoRA), and three `cpu` sampler groups (bf16, fp8 with an fp8 KV cache,
nvfp4). test_node_fleet.py runs the megatron backend and test_node_lora.py the torch backend training an
adapter; this one holds the torch backend's full fine-tuning as pods, on the trainer image's own torch (2.6,
whose gloo reduce-scatter sums where FSDP2 asks for the average: the backend measures it at startup and
scales the gradients by what it found, bda8636). What the pods and the store show:

- the trainer pod runs torchrun with `NPROC_PER_NODE` 2, its rank 0 logs what the reduce-scatter does
  (`FSDP2 over 2 gloo ranks (torch V): the gradient reduce-scatter averages|sums`), its container never
  restarts, and it trains past step 2 with a finite loss and gradient norm, the norm non-zero at every
  step with a learning signal (its step history, in its checkpoint in the store);
- the channel publishes every version as the three full views (bf16, fp8, nvfp4; no `lora` view, no LoRA
  base), and a version comes whose three views all hold other bytes than version 0's: all the weights train;
- every group serves a trained version: `kubectl get sg`'s VERSION >= 1, and read in the pod (`kubectl
  exec`, the job's key on stdin) the sidecar in sync on its group's view at a version >= 1 that its engine's
  /model_info reports serving, applied from that full view (its log line).

The tests share one fleet (module scope) and run in file order. The file sorts before test_node_pods.py,
whose last test stops the node (the conftest moves it last anyway).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.node_job import NodeJob, delete_job_and_operator, example_rljob, watching_versions
from support.operator_chart import install_operator_reading_claim

from rlfleet.channel import Manifest
from rlfleet.lora import LORA_VIEW
from rlfleet.operator import naming

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-cpu-torch.yaml"
JOB = "cpu-torch"  # metadata.name in the example
GROUPS = ("bf16", "fp8", "nvfp4")  # each group's name is its weight format, the view it follows
CLAIM = "rlfleet-cpu-torch-weights"
STORE_PATH = "/weights/cpu-torch"
# The one change to the example: more steps, so that the run is still training (its sampler pods serving)
# while the checks below read it; the fixture deletes the job at the end.
TOTAL_STEPS = 2000
MIN_VERSIONS = 3  # versions 0, 1, 2 read from the store


@dataclass
class Fleet(NodeJob):
    job = JOB
    claim = CLAIM
    group_names = GROUPS
    kube: Any  # controlplane.KubeCluster
    ns: str
    started: float
    versions_seen: list[int] = field(default_factory=list)  # the channel's latest version, polled
    manifests: dict[int, Manifest] = field(default_factory=dict)  # every version's manifest, read as it lands

    def applied(self, pod: str) -> list[tuple[int, str]]:
        """(version, view) of every version the pod's sidecar applied, in order (its log line per version)."""
        return [(int(m.group(1)), m.group(2)) for m in APPLIED.finditer(self.logs(pod, "weight-sync"))]


# rank 0's line (trainer/backends/backend_hf.py): what the image's torch's gloo reduce-scatter does
REDUCE_SCATTER = re.compile(
    r"FSDP2 over (\d+) gloo ranks \(torch (\S+)\): the gradient reduce-scatter (averages|sums)"
)
# The sidecar's line per version it applied (sampler/syncer.py): the version and the view it came from.
APPLIED = re.compile(r"applied weights v(\d+) \((\w+)\) from ")
# Run in the weight-sync container (python3 -I): the job's key on stdin (never on a command line).
ENGINE_PROBE = (
    "import json, sys, urllib.request\n"
    "key = sys.stdin.read().strip()\n"
    f"sidecar = 'http://127.0.0.1:{naming.SYNC_PORT}'\n"
    f"engine = 'http://127.0.0.1:{naming.SGLANG_PORT}'\n"
    "def get(url, auth=False):\n"
    "    headers = {'Authorization': 'Bearer ' + key} if auth else {}\n"
    "    return json.load(urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30))\n"
    "before = get(sidecar + '/status')\n"
    "info = get(engine + '/model_info', auth=True)\n"
    "after = get(sidecar + '/status')\n"
    "print(json.dumps({'before': before, 'model_info': info, 'after': after}))\n"
)


def _restarts(pod: dict[str, Any]) -> dict[str, int]:
    statuses = pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", [])
    return {c["name"]: int(c.get("restartCount", 0)) for c in statuses}


@pytest.fixture(scope="module")
def fleet(dev_cluster) -> Iterator[Fleet]:
    kube = dev_cluster.kube
    ns = f"torch-{uuid.uuid4().hex[:6]}"
    install_operator_reading_claim(
        kube, dev_cluster.images["operator"].ref, ns, store="cpu-torch", claim=CLAIM, mount_path=STORE_PATH
    )
    docs, job = example_rljob(EXAMPLE)
    trainer = job["spec"]["trainer"]
    assert job["metadata"]["name"] == JOB and trainer["backend"] == "torch" and "lora" not in trainer, trainer
    assert trainer["processesPerReplica"] == 2, trainer
    assert [g["weightFormat"] for g in job["spec"]["samplerGroups"]] == list(GROUPS), job["spec"]
    trainer["totalSteps"] = TOTAL_STEPS  # the run must outlast the checks (above)
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
    fleet = Fleet(kube, ns, time.monotonic())
    try:
        with watching_versions(fleet, on_version=fleet.read_new_manifests):
            yield fleet
    finally:
        delete_job_and_operator(kube, ns)


def test_the_torch_trainer_fine_tunes_every_view_on_two_gloo_ranks(fleet: Fleet) -> None:
    """torchrun with 2 ranks in the trainer pod, rank 0's reduce-scatter line, steps past 2 with a finite
    loss and gradient norm, every version published as the three full views, and one with all three changed
    since v0."""
    step = fleet.wait_step(2, timeout=1500)
    print(f"step {step} after {time.monotonic() - fleet.started:.0f}s from apply")
    trainer = fleet.kube.get_json("pod", f"{JOB}-trainer-0", "-n", fleet.ns)
    [container] = [c for c in trainer["spec"]["containers"] if c["name"] == "trainer"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("NPROC_PER_NODE") == "2", env  # torchrun --nproc-per-node=$(NPROC_PER_NODE): 2 gloo ranks
    log = fleet.logs(f"{JOB}-trainer-0", "trainer")
    assert "LoRA:" not in log, log[-3000:]  # full fine-tuning: no adapter
    reduce = REDUCE_SCATTER.search(log)
    assert reduce and reduce.group(1) == "2", log[-3000:]
    print(f"trainer image torch {reduce.group(2)}: the reduce-scatter {reduce.group(3)}")

    def signal(row: dict[str, float]) -> bool:
        """A step with a learning signal: some prompt's samples got different rewards (a step whose every
        group is uniform has zero advantages everywhere, and a zero gradient)."""
        return row.get("uniform_group_fraction", 1.0) < 1.0

    def trained_rows() -> list[dict[str, float]] | None:
        rows = [r for r in fleet.history() if r.get("trained_tokens")]
        return rows if len(rows) >= 2 and any(signal(r) for r in rows) else None

    rows = fleet.wait(
        "the trainer's checkpoint holding 2 trained steps, one with a learning signal",
        trained_rows,
        timeout=600,
    )
    print(
        "step, loss, grad_norm, uniform_group_fraction:",
        [(int(r["step"]), r.get("loss"), r.get("grad_norm"), r.get("uniform_group_fraction")) for r in rows],
    )
    for row in rows:
        # the trainer drops a non-finite metric from its row (trainer/metrics.py finite): absent = not finite
        assert "loss" in row and math.isfinite(row["loss"]), row
        assert "grad_norm" in row and math.isfinite(row["grad_norm"]), row
        if signal(row):  # the gradient reached the parameters
            assert row["grad_norm"] > 0, row
    trainer = fleet.kube.get_json("pod", f"{JOB}-trainer-0", "-n", fleet.ns)
    assert set(_restarts(trainer).values()) == {0}, _restarts(trainer)  # no crash loop on the way

    def changed_version() -> int | None:
        """The first version read whose every view holds other bytes than version 0's (each file's digest is
        the complete file's, stored whole or as a delta). Not every version: a step without a learning
        signal leaves the weights as they were, and a small update can round to the same bf16 or fp8 bytes."""
        manifests = dict(fleet.manifests)
        if 0 not in manifests or len(manifests) < MIN_VERSIONS:
            return None
        v0 = manifests[0]
        for version, manifest in sorted(manifests.items()):
            if version and all(manifest.views[view].files != v0.views[view].files for view in GROUPS):
                return version
        return None

    changed = fleet.wait("a version whose three views all changed since v0", changed_version, timeout=900)
    manifests = dict(fleet.manifests)
    for version, manifest in sorted(manifests.items()):
        assert set(manifest.views) == set(GROUPS), (version, sorted(manifest.views))
        assert LORA_VIEW not in manifest.views and "lora_base" not in manifest.metadata, (
            version,
            manifest.metadata,
        )
    print(
        f"{len(manifests)} versions read ({min(manifests)}..{max(manifests)}), each the views "
        f"{ {view: manifests[0].views[view].bytes for view in GROUPS} } B at v0; v{changed} the first with "
        "every view changed since v0"
    )

    def channel_status() -> dict[str, Any] | None:
        """The WeightChannel's status once it names a version >= 1 (the operator writes it on its own
        interval: it may still say 0 when the store already holds later versions)."""
        [wc] = fleet.kube.get_json("weightchannels", "-n", fleet.ns)["items"]
        status = wc.get("status", {})
        return status if (status.get("latestVersion") or 0) >= 1 else None

    status = fleet.wait("the WeightChannel's status naming a version >= 1", channel_status, timeout=300)
    assert not status.get("loraBase"), status
    assert sorted(a["view"] for a in status.get("artifacts") or []) == sorted(GROUPS), status
    print(fleet.kube.kubectl("get", "rlj,wc", "-n", fleet.ns).stdout)


def test_every_group_serves_a_trained_version(fleet: Fleet) -> None:
    """`kubectl get sg`'s VERSION >= 1 for every group; in each sampler pod the sidecar, in sync on its
    group's full view, applied a version >= 1 that the engine's /model_info says it serves."""

    versions = fleet.wait(
        "`kubectl get sg` with a VERSION >= 1 for every group",
        lambda: fleet.served_versions(GROUPS),
        timeout=900,
    )
    print(fleet.kube.kubectl("get", "samplergroups", "-n", fleet.ns).stdout)
    for group in GROUPS:
        [pod] = fleet.sampler_pods(group)
        name = pod["metadata"]["name"]

        def settled(n: str = name) -> dict[str, Any] | None:
            got = fleet.probe(n, ENGINE_PROBE)
            before, after = got["before"], got["after"]
            same = before["phase"] == after["phase"] == "in-sync"
            same = same and before["applied_version"] == after["applied_version"]
            return got if same and (after["applied_version"] or 0) >= 1 else None

        got = fleet.wait(f"the {group} sidecar in sync at a version >= 1", settled, timeout=300, interval=0.5)
        status, serving = got["after"], got["model_info"]["weight_version"]
        assert status["view"] == group and status["mode"] == "disk", status  # not "lora"
        assert serving == str(status["applied_version"]), (group, serving, status)
        assert status["failures"].get("checksum", 0) == 0, status
        applied = fleet.applied(name)
        assert (status["applied_version"], group) in applied, (group, status["applied_version"], applied)
        assert {view for _, view in applied} == {group}, (group, applied)  # the full view, never `lora`
        print(
            f"{group}: serves v{serving} (sg VERSION {versions[group]}); sidecar applied "
            f"{[v for v, _ in applied]} of view {group}"
        )
        assert set(_restarts(pod).values()) == {0}, (name, _restarts(pod))
