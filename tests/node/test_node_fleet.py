"""The CPU example fleet on the real node: `helm install` of charts/rlfleet (its own RBAC, the store's PVC
mounted into the operator), then `kubectl apply -f examples/rljob-cpu.yaml` as it is: three `cpu` sampler
groups (bf16, fp8 with an fp8 KV cache, nvfp4) and a megatron trainer at tensor parallel 2 on two gloo
ranks. It trains, the cockpit fills from real scrapes of real pods, versions between anchors are
stored and read as deltas (every group rebuilds them, verified), and faults are survived: a sampler
pod deleted (it comes back from an anchor plus deltas), the operator pod deleted, a corrupted view,
the trainer pod killed, the store's volume full; deleting the RLJob leaves no pod. The store is a
small tmpfs on the node (a PV of it) so that it can be filled.

The tests share one fleet (module scope) and run in file order: each phase starts from the state the
previous one left, as an operator's day would. Each asserts its own outcome; a phase that fails leaves
the next ones to report theirs. The file sorts before test_node_pods.py, whose last test stops the node.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.node_job import NodeJob, delete_job_and_operator, example_rljob, ready, watching_versions
from support.operator_chart import install_operator_reading_claim
from support.waits import wait_for

from rlfleet.channel import Manifest
from rlfleet.operator import naming

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
JOB = "cpu"  # metadata.name in the example
GROUPS = ("bf16", "fp8", "nvfp4")
CLAIM = "rlfleet-cpu-weights"
STORE_PATH = "/weights/cpu"
TOTAL_STEPS = 2000
STORE_VOLUME_SIZE = "128m"  # a few versions (1.3 MB each, 3 views) and two checkpoints of the tiny model
# The example's learning rate (2e-4, so that the demo learns within its 50 steps) moves nearly every bf16
# element at every step: each bf16 delta would exceed maxDeltaShare and every bf16 version is stored whole
# (`rlfleet run examples/rljob-cpu.yaml --local`: 9 anchors of 9 bf16 versions; fp8 and nvfp4 deltas 11-46%
# of the view). The fleet here trains at an RL learning rate, examples/rljob.yaml's 1e-6, where the
# versions between anchors are deltas of 2-5% of each view (the same local run at 1e-6, 20 steps: a bf16
# delta 2.1% of the view on average, fp8 2.6%, nvfp4 3.1%).
LEARNING_RATE = 1e-6
ANCHOR_EVERY = (
    16  # the example leaves weightChannel.deltas at its defaults (rlfleet.api DEFAULT_ANCHOR_EVERY)
)
DELTA_SHARE_AT_MOST = 0.10  # a delta version stores (and a replica following every version reads) this share of the view, at most


@dataclass
class Fleet(NodeJob):
    job = JOB
    claim = CLAIM
    kube: Any  # controlplane.KubeCluster
    ns: str
    started: float
    versions_seen: list[int] = field(default_factory=list)  # the channel's latest version, polled
    manifests: dict[int, Manifest] = field(default_factory=dict)  # every version's manifest, read as it lands

    def rljob(self) -> dict[str, Any]:
        return self.kube.get_json("rljob", JOB, "-n", self.ns)

    def status(self) -> dict[str, Any]:
        return self.rljob().get("status", {})

    def sidecar(self, pod: str) -> dict[str, Any]:
        """What a sampler pod's weight-sync sidecar serves on its port (read from inside the pod): its
        /metrics' bytes read per kind and applies, then its /status."""
        out = self.kube.kubectl(
            "exec", "-n", self.ns, pod, "-c", "weight-sync", "--", "python3", "-I", "-c", SIDECAR_PROBE
        ).stdout
        got = json.loads(out.strip().splitlines()[-1])
        read, applies = {}, None
        for line in got["metrics"].splitlines():
            if m := re.match(r'^rlfleet_weight_sync_read_bytes_total\{.*kind="([^"]+)".*\} (\S+)$', line):
                read[m.group(1)] = int(float(m.group(2)))
            elif m := re.match(r"^rlfleet_weight_sync_applies_total\{.*\} (\S+)$", line):
                applies = int(float(m.group(1)))
        return {"read_bytes": read, "applies": applies, "status": got["status"], "settled": got["settled"]}

    def diagnosis(self) -> str:
        """What the RLJob, the trainer pod and the operator say (a failure's report: a phase that timed out
        in CI must say why there)."""
        parts = [f"RLJob status: {self.status()}"]
        for pod in self.pods(f"rlfleet.dev/job={JOB}"):
            name = pod["metadata"]["name"]
            if "trainer" in name:
                states = [
                    {k: c.get(k) for k in ("name", "ready", "restartCount", "state", "lastState")}
                    for c in pod["status"].get("containerStatuses", [])
                ]
                parts.append(f"pod {name}: phase {pod['status'].get('phase')}, containers {states}")
        for label, pod, container in (("trainer", f"{JOB}-trainer-0", "trainer"),):
            parts.append(f"{label} log tail:\n{self.log_tail(pod, container, lines=40)}")
        for op in self.pods("app.kubernetes.io/name=rlfleet"):
            parts.append(
                f"operator {op['metadata']['name']} log tail:\n{self.log_tail(op['metadata']['name'], None, lines=40)}"
            )
        return "\n".join(parts)


@pytest.fixture(scope="module")
def fleet(dev_cluster) -> Iterator[Fleet]:
    kube = dev_cluster.kube
    ns = f"fleet-{uuid.uuid4().hex[:6]}"
    install_operator_reading_claim(
        kube, dev_cluster.images["operator"].ref, ns, store="cpu", claim=CLAIM, mount_path=STORE_PATH
    )
    # The store's volume: a small tmpfs on the node, so that a test can fill it (a local-path volume is a
    # directory on the host's big disk). A PV of it, and the example's claim bound to it; the example's
    # own PVC then applies as a no-op (created here without kubectl's last-applied annotation).
    volume = Path(tempfile.mkdtemp(prefix="rlfleet-fleet-store-"))
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={STORE_VOLUME_SIZE},mode=0777", "tmpfs", str(volume)],
        check=True,
    )
    pv_name = f"{ns}-store"
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "2Gi"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(volume), "type": "Directory"},
                "claimRef": {"namespace": ns, "name": CLAIM},
            },
        },
        create=True,
    )
    kube.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "2Gi"}},
            },
        },
        namespace=ns,
        create=True,
    )
    # the example as users apply it (the PVC with it), with more steps: the faults below need a run that
    # is still training (the example's 50 steps take about two minutes here); at an RL learning rate
    docs, job = example_rljob(EXAMPLE)
    job["spec"]["trainer"]["totalSteps"] = TOTAL_STEPS
    job["spec"]["trainer"]["optimizer"]["learningRate"] = LEARNING_RATE  # deltas between anchors (above)
    assert "deltas" not in job["spec"]["weightChannel"]  # the defaults: an anchor every ANCHOR_EVERY versions
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
    fleet = Fleet(kube, ns, time.monotonic())
    try:
        with watching_versions(fleet, on_version=fleet.read_new_manifests):
            yield fleet
    finally:
        delete_job_and_operator(kube, ns)
        kube.kubectl("delete", "pv", pv_name, "--wait=false", check=False)
        subprocess.run(["umount", "-l", str(volume)], check=False)
        volume.rmdir()


def test_the_cpu_example_trains_and_fills_the_cockpit(fleet: Fleet) -> None:
    """Pod start to a trained step, then every column of `kubectl get rlj,sg` from real scrapes."""
    step = fleet.wait_step(2, timeout=1200)
    print(f"step {step} after {time.monotonic() - fleet.started:.0f}s from apply")

    def cockpit_full() -> dict[str, dict[str, Any]] | None:
        groups = fleet.groups()
        if len(groups) != len(GROUPS):
            return None
        for sg in groups.values():
            s = sg.get("status", {})
            if not (
                s.get("readyReplicas") == 1
                and (s.get("tokensPerSecond") or 0) > 0
                and s.get("sharePercent") is not None
                and (s.get("appliedWeightVersion") or 0) >= 1
                and s.get("versionLag") is not None
                and s.get("kl") is not None
                and s.get("oorFraction") is not None
            ):
                return None
        return groups

    groups = wait_for(
        "every SamplerGroup Ready with Tok/s, Share%, Version, Lag, KL and OOR", cockpit_full, timeout=600
    )
    shares = [float(sg["status"]["sharePercent"]) for sg in groups.values()]
    assert abs(sum(shares) - 100) < 1.5, shares
    status = fleet.status()
    assert status.get("weightVersion", 0) >= 1 and status.get("metrics", {}).get("reward") is not None, status
    table = fleet.kube.kubectl("get", "rlj,sg", "-n", fleet.ns).stdout
    print(table)
    # `kubectl logs` works for every container of every pod, init containers included
    for pod in fleet.pods("app.kubernetes.io/part-of=rlfleet"):
        spec = pod["spec"]
        for container in spec.get("initContainers", []) + spec["containers"]:
            out = fleet.logs(pod["metadata"]["name"], container["name"])
            assert out.strip() or container["name"] == "router", (pod["metadata"]["name"], container["name"])


# Read from inside a sampler pod (`kubectl exec`): its sidecar's /status, /metrics, /status again (Fleet.sidecar):
# the metrics belong to the second status when nothing was applied between (`settled`).
SIDECAR_PROBE = (
    "import json, urllib.request\n"
    f"base = 'http://127.0.0.1:{naming.SYNC_PORT}'\n"
    "before = json.load(urllib.request.urlopen(base + '/status', timeout=30))\n"
    "metrics = urllib.request.urlopen(base + '/metrics', timeout=30).read().decode()\n"
    "status = json.load(urllib.request.urlopen(base + '/status', timeout=30))\n"
    "settled = all(s['phase'] == 'in-sync' for s in (before, status)) and before['applied_version'] == "
    "status['applied_version']\n"
    "print(json.dumps({'metrics': metrics, 'status': status, 'settled': settled}))\n"
)
# The sidecar's line per version it applied and the init container's launch line (sampler/syncer.py): how the
# version was obtained and the bytes read from the store per kind.
APPLIED = re.compile(
    r"applied weights v(\d+) \((\w+)\) from (.+?), (\d+) bytes read "
    r"\(anchor (\d+), delta (\d+), whole-file (\d+)\): obtain"
)
LAUNCHED = re.compile(
    r"launch checkpoint: v(\d+) \((\w+)\) at \S+, from (.+?), (\d+) bytes read "
    r"\(anchor (\d+), delta (\d+), whole-file (\d+)\)"
)


@dataclass(frozen=True)
class Obtained:
    """One version a sidecar (or init container) obtained, as its log line says."""

    version: int
    source: str  # e.g. "anchor v16 + deltas v17, v18", "local v18 + delta v19"
    read: dict[str, int]  # bytes read from the store per kind (anchor, delta, whole-file)


def _obtained(log: str, line: re.Pattern[str]) -> list[Obtained]:
    got = []
    for m in line.finditer(log):
        read = {"anchor": int(m.group(5)), "delta": int(m.group(6)), "whole-file": int(m.group(7))}
        assert sum(read.values()) == int(m.group(4)), m.group(0)
        got.append(Obtained(int(m.group(1)), m.group(3), read))
    return got


def _expected(manifests: dict[int, Manifest], view: str, version: int, local: set[int]) -> Obtained:
    """What obtaining `version` of `view` holding verified copies of the versions `local` must say and read,
    from the manifests alone: back through each delta's base to a local copy or the anchor, then every version
    after it built in order; per version its payloads read, its other files read whole unless the same file
    (same digest) was in the version before (docs/weights.md, "Rebuilding a view")."""
    built, at = [], version
    while at not in local:
        built.insert(0, at)
        if manifests[at].views[view].delta is None:
            break
        at = manifests[at].views[view].delta.base  # type: ignore[union-attr]
    seed = f"local v{at}" if at in local else f"anchor v{at}"
    base = manifests[at].views[view] if at in local else None
    read = {"anchor": 0, "delta": 0, "whole-file": 0}
    for at in built:
        vm = manifests[at].views[view]
        rebuilt = set() if vm.delta is None else set(vm.delta.rebuilt())
        for rel, entry in vm.files.items():
            if base is not None and base.files.get(rel) == entry:
                continue  # copied from the version before
            if vm.delta is not None and rel in rebuilt:
                read["delta"] += vm.delta.files[rel + ".delta"].bytes
            else:
                read["anchor" if vm.delta is None else "whole-file"] += entry.bytes
        base = vm
    deltas = [v for v in built if manifests[v].views[view].delta is not None]
    named = ", ".join(f"v{v}" for v in deltas)
    return Obtained(
        version, f"{seed} + delta{'s' if len(deltas) > 1 else ''} {named}" if deltas else seed, read
    )


def _since_anchor(manifests: dict[int, Manifest], view: str, version: int) -> int:
    """Deltas from `version` of `view` back to its anchor (0: an anchor)."""
    deltas = 0
    while (delta := manifests[version].views[view].delta) is not None:
        version, deltas = delta.base, deltas + 1
    return deltas


def test_versions_between_anchors_are_deltas_that_every_group_rebuilds_verified(fleet: Fleet) -> None:
    """issue 40 item 7: the trainer stores each view whole every ANCHOR_EVERY versions (the example's default)
    and as a delta of a few % of the view between (every manifest, read as it landed); the WeightChannel's
    status and `kubectl get wc` say so. Each group's sidecar rebuilds the delta versions from its previous
    copy, every one verified (no checksum or delta failure), and reads exactly the payloads the manifests
    list (its log line per version); its /metrics' bytes read per kind are the sum of those lines; and one
    rebuild's bytes per group (its line for the versions it built from its copy) are their delta payloads: a
    few % of those versions' full views."""
    [wc] = fleet.kube.get_json("weightchannels", "-n", fleet.ns)["items"]
    assert (wc["spec"].get("deltas") or {}).get("anchorEvery", ANCHOR_EVERY) == ANCHOR_EVERY, wc["spec"]
    wait_for(
        f"version {ANCHOR_EVERY + 3}: the second anchor and deltas after it",
        lambda: max(fleet.manifests, default=-1) >= ANCHOR_EVERY + 3,
        timeout=900,
    )
    _assert_anchors_every_k_and_deltas_between(dict(fleet.manifests))
    _assert_the_channel_status_names_a_delta_version(fleet)
    rebuilds = {group: _assert_the_sidecar_rebuilds_verified(fleet, group) for group in GROUPS}
    # what the versions each rebuild built (after its copy, up to its target) weigh as full views
    full = {
        g: sum(fleet.manifests[v].views[g].bytes for v in range(copy + 1, version + 1))
        for g, (copy, version, _) in rebuilds.items()
    }
    read_total = sum(sum(read.values()) for *_, read in rebuilds.values())
    for group, (copy, version, read) in rebuilds.items():
        print(
            f"{group}: v{copy} -> v{version} read {sum(read.values())} B of {full[group]} B as full views ({read})"
        )
    print(f"over the {len(GROUPS)} groups: {read_total} B of {sum(full.values())} B as full views")
    assert 0 < read_total <= DELTA_SHARE_AT_MOST * sum(full.values()), (rebuilds, full)


def _assert_anchors_every_k_and_deltas_between(manifests: dict[int, Manifest]) -> None:
    assert sorted(manifests) == list(range(max(manifests) + 1)), sorted(manifests)  # each read as it landed
    for view in GROUPS:
        anchors = [v for v, m in sorted(manifests.items()) if m.views[view].delta is None]
        assert anchors == list(range(0, max(manifests) + 1, ANCHOR_EVERY)), (view, anchors)
        for version, manifest in sorted(manifests.items()):
            vm = manifest.views[view]
            if vm.delta is not None:
                assert vm.delta.base == version - 1 and vm.delta.bytes > 0, (view, version, vm.delta)
                assert vm.stored_bytes <= DELTA_SHARE_AT_MOST * vm.bytes, (
                    view,
                    version,
                    vm.stored_bytes,
                    vm.bytes,
                )


def _assert_the_channel_status_names_a_delta_version(fleet: Fleet) -> None:
    """The WeightChannel's status of a delta version (the latest is one 15 times in 16): per view its kind,
    base and stored bytes, as the manifest says; Stored% a few %, in `kubectl get wc` too."""

    def delta_version() -> dict[str, Any] | None:
        status = fleet.kube.get_json("weightchannels", "-n", fleet.ns)["items"][0].get("status", {})
        artifacts = status.get("artifacts") or []
        views = sorted(a["view"] for a in artifacts)
        deltas = all(a.get("kind") == "delta" and a["version"] in fleet.manifests for a in artifacts)
        return status if views == sorted(GROUPS) and deltas else None

    status = wait_for("the WeightChannel's status naming a delta version", delta_version, timeout=600)
    for artifact in status["artifacts"]:
        vm = fleet.manifests[artifact["version"]].views[artifact["view"]]
        assert (artifact["storedBytes"], artifact["bytes"], artifact["base"]) == (
            vm.stored_bytes,
            vm.bytes,
            artifact["version"] - 1,
        ), artifact
    assert 0 < status["storedPercent"] <= 100 * DELTA_SHARE_AT_MOST, status
    table = fleet.kube.kubectl("get", "wc", "-n", fleet.ns).stdout
    print(table)
    header, row = table.strip().splitlines()[:2]
    stored = float(row.split()[header.split().index("STORED%")])  # a version read later: still a delta or 100
    assert 0 < stored <= 100 * DELTA_SHARE_AT_MOST or stored == 100, table


def _settled(fleet: Fleet, pod: str) -> tuple[dict[str, Any], list[Obtained]] | None:
    """A sidecar's /metrics and /status while it obtains nothing, and its log's lines up to the version it
    serves (the log is read after: a version applied since is left out)."""
    snap = fleet.sidecar(pod)
    if not snap["settled"]:  # in sync before and after its /metrics were read, the same version applied
        return None
    serving = snap["status"]["applied_version"]
    return snap, [o for o in _obtained(fleet.logs(pod, "weight-sync"), APPLIED) if o.version <= serving]


def _assert_the_sidecar_rebuilds_verified(fleet: Fleet, group: str) -> tuple[int, int, dict[str, int]]:
    """Every version the group's sidecar applied was obtained as the manifests say, with exactly their bytes
    read, none refused; its counters are the sum of its lines. Returns (the copy's version, the version
    built, the bytes read) of its rebuild from a local copy through the fewest deltas: that version's line,
    one term of its counters' sum."""
    [pod] = fleet.sampler_pods(group)
    name = pod["metadata"]["name"]

    seen: list[Obtained] = []

    def rebuilt_three() -> list[Obtained] | None:
        # a sidecar that fell more than one version behind folds several deltas onto its copy at once
        # ("local v6 + deltas v7, v8"): a rebuild from its copy all the same
        seen[:] = _obtained(fleet.logs(name, "weight-sync"), APPLIED)
        from_copy = sum(_rebuilt_from_copy(o) for o in seen)
        return seen if from_copy >= 3 else None

    try:
        obtained = wait_for(
            f"the {group} sidecar applying 3 versions rebuilt from its copy plus deltas",
            rebuilt_three,
            timeout=600,
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; it obtained: {[(o.version, o.source) for o in seen]}") from None
    for got in obtained:
        local = {_copy_version(got)} if got.source.startswith("local v") else set()
        assert got == _expected(fleet.manifests, group, got.version, local), (group, got)
    snap, lines = wait_for(
        f"the {group} sidecar in sync", lambda: _settled(fleet, name), timeout=300, interval=0.2
    )
    status = snap["status"]
    assert status["failures"]["checksum"] == 0 and status["failures"]["delta"] == 0, status
    logged = {kind: sum(o.read[kind] for o in lines) for kind in ("anchor", "delta", "whole-file")}
    assert snap["read_bytes"] == status["read_bytes"] == logged, (group, snap["read_bytes"], logged)
    assert snap["applies"] == len(lines) and logged["delta"] > 0, (group, snap["applies"], len(lines))
    # one rebuild's bytes, as its line says (the lines are what it read, exactly, and its counters their sum):
    # the rebuild from its copy that folded the fewest deltas (a sidecar behind the trainer folds several)
    from_copy = [o for o in lines if _rebuilt_from_copy(o)]
    assert from_copy, (group, [(o.version, o.source) for o in lines])
    one = min(from_copy, key=lambda o: (o.version - _copy_version(o), -o.version))
    assert one == _expected(fleet.manifests, group, one.version, {_copy_version(one)}), (group, one)
    return _copy_version(one), one.version, one.read


def _rebuilt_from_copy(obtained: Obtained) -> bool:
    """Built from the sidecar's own verified copy plus deltas ("local v6 + deltas v7, v8")."""
    return obtained.source.startswith("local v") and " + delta" in obtained.source


def _copy_version(obtained: Obtained) -> int:
    """The version of the local copy a rebuild started from ("local v6 + deltas v7, v8" -> 6)."""
    return int(obtained.source.split()[1][1:])


# A pod on the pod network without the job's key (sys.argv: a sampler pod's engine URL, the router's URL):
# the HTTP status of each call, as JSON on stdout.
UNKEYED_CLIENT = """
import json, sys, time, urllib.error, urllib.request
engine, router, sidecar, admitted_within = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def call(method, url, key=None, body=None):
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:  # no HTTP answer: the network refused or dropped the connection
        return "no answer: " + str(getattr(e, "reason", e))
# a pod the policies let in is let in once the node's firewall has its IP (kube-router adds it to the
# allowed sources at its sync after the pod started): until then it is refused like an outsider
deadline = time.monotonic() + admitted_within
while time.monotonic() < deadline and not all(isinstance(call("GET", u + "/health"), int) for u in (engine, router)):
    time.sleep(0.5)
foreign = {"model_path": "/tmp", "weight_version": "1000000"}
turn = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
print(json.dumps({
    "update_no_key": call("POST", engine + "/update_weights_from_disk", body=foreign),
    "update_wrong_key": call("POST", engine + "/update_weights_from_disk", key="wrong", body=foreign),
    "pause_no_key": call("POST", engine + "/pause_generation", body={}),
    "generate_no_key": call("POST", engine + "/generate", body=turn),
    "engine_health": call("GET", engine + "/health"),
    "engine_metrics": call("GET", engine + "/metrics"),
    "router_no_key": call("POST", router + "/generate", body=turn),
    "router_health": call("GET", router + "/health"),
    "sidecar_health": call("GET", sidecar + "/health"),
}))
"""


def _run_client_pod(
    fleet: Fleet, image: str, name: str, labels: dict[str, str], args: list[str]
) -> dict[str, Any]:
    """UNKEYED_CLIENT in a pod of the fleet's namespace with `labels`; its printed answers. args: the engine's,
    the router's and the sidecar's URLs, and how many seconds it waits for the network to let it in."""
    kube, ns = fleet.kube, fleet.ns
    client = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeSelector": {"rlfleet.dev/dev-node": "true"},
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["/opt/rlfleet/bin/python", "-c", UNKEYED_CLIENT, *args],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "runAsGroup": 10001,
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                }
            ],
        },
    }
    kube.apply(client, namespace=ns)
    try:
        wait_for(
            f"the {name} pod done",
            lambda: kube.get_json("pod", name, "-n", ns)["status"].get("phase") in ("Succeeded", "Failed"),
            timeout=300,
        )
        out = kube.kubectl("logs", "-n", ns, name).stdout
    finally:
        kube.kubectl("delete", "pod", name, "-n", ns, "--wait=false", check=False)
    return json.loads(out.strip().splitlines()[-1])


def test_the_engines_and_the_router_refuse_a_caller_without_the_jobs_key(fleet: Fleet, dev_cluster) -> None:
    """The job's engine API is closed twice (docs/sampler.md, "The engine API"; docs/install.md, "Network
    policies"), and the real node enforces both: its NetworkPolicies (kube-router's firewall, docs/dev-cluster.md)
    refuse a pod of the namespace that is none of the router, the operator or a metrics scraper at the
    engine's and the router's ports (the sidecar's read-only port stays open to it); a pod the policies
    let in (labelled as Prometheus, the default scraper) but without the job's key gets 401 from a
    sampler's /update_weights_from_disk, /pause_generation and /generate and from the router, while
    /health and /metrics answer. The key is in no pod spec (secretKeyRef only); the fleet, which holds
    it, trains on and applies versions."""
    kube, ns = fleet.kube, fleet.ns
    policies = {p["metadata"]["name"] for p in kube.get_json("networkpolicies", "-n", ns)["items"]}
    assert {f"{JOB}-samplers", f"{JOB}-router"} <= policies, policies
    key = base64.b64decode(kube.get_json("secret", f"{JOB}-api-key", "-n", ns)["data"]["key"]).decode()
    pods = fleet.pods(f"rlfleet.dev/job={JOB}")
    assert pods and key not in json.dumps(pods)
    for pod in pods:
        for container in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            [ref] = [e for e in container.get("env", []) if e["name"] == "RLFLEET_API_KEY"]
            assert ref["valueFrom"]["secretKeyRef"] == {"name": f"{JOB}-api-key", "key": "key"}, container[
                "name"
            ]

    [sampler] = fleet.sampler_pods("bf16")
    applied_before = fleet.groups()[f"{JOB}-bf16"]["status"].get("appliedWeightVersion") or 0
    step = fleet.step()
    pod_ip = sampler["status"]["podIP"]
    args = [
        f"http://{pod_ip}:{naming.SGLANG_PORT}",
        f"http://{JOB}-router.{ns}.svc:{naming.ROUTER_PORT}",
        f"http://{pod_ip}:{naming.SYNC_PORT}",
    ]
    image = dev_cluster.images["operator"].ref
    outsider = _run_client_pod(fleet, image, "unlisted-client", {"role": "outsider"}, [*args, "0"])
    refused = {k: v for k, v in outsider.items() if k != "sidecar_health"}
    assert all(isinstance(v, str) and v.startswith("no answer") for v in refused.values()), outsider
    assert outsider["sidecar_health"] == 200, outsider  # the same pod, the same node: only the policy differs
    scraper = _run_client_pod(
        fleet, image, "unkeyed-client", {"app.kubernetes.io/name": "prometheus"}, [*args, "120"]
    )
    assert scraper == {
        "update_no_key": 401,
        "update_wrong_key": 401,
        "pause_no_key": 401,
        "generate_no_key": 401,
        "engine_health": 200,
        "engine_metrics": 200,
        "router_no_key": 401,
        "router_health": 200,
        "sidecar_health": 200,
    }, scraper
    # the fleet holds the key: it trains on, the bf16 engine applies new versions, and nothing foreign was
    # loaded (the sidecar would have said so)
    fleet.wait_step(step + 2)
    wait_for(
        "the bf16 group applying a newer version",
        lambda: (fleet.groups()[f"{JOB}-bf16"]["status"].get("appliedWeightVersion") or 0) > applied_before,
        timeout=600,
    )
    assert "foreign weight version" not in fleet.logs(sampler["metadata"]["name"], "weight-sync")
    assert fleet.groups()[f"{JOB}-bf16"]["status"]["reason"] != "ForeignWeightVersion"


def _suspended_job(name: str, group: str) -> str:
    """An RLJob of the example's shape, suspended (no pod), with one group and its own store path."""
    _, job = example_rljob(EXAMPLE)
    job["metadata"]["name"] = name
    job["spec"]["suspend"] = True
    job["spec"]["samplerGroups"] = [{**job["spec"]["samplerGroups"][0], "name": group}]
    job["spec"]["weightChannel"]["store"]["path"] = f"{STORE_PATH}/{name}"  # not the fleet's channel
    return yaml.safe_dump(job)


def test_the_charts_webhook_refuses_a_job_whose_group_name_is_taken(fleet: Fleet) -> None:
    """The chart's validating webhook (on by default: its Service, the operator's self-signed certificate
    in a Secret, the caBundle it patches) answers the API server over TLS through the Service: job `ab`
    with group `cd-ef` owns SamplerGroup ab-cd-ef, so job `ab-cd` with group `ef` is refused at apply,
    naming the owner (docs/install.md, "Admission webhook")."""
    kube, ns = fleet.kube, fleet.ns
    secret = kube.get_json("secret", "rlfleet-webhook-cert", "-n", ns)
    configuration = kube.get_json("validatingwebhookconfiguration", f"rlfleet-{ns}")
    ca = secret["data"]["ca.crt"]
    wait_for(
        "the caBundle the operator patches",
        lambda: all(
            w.get("clientConfig", {}).get("caBundle") == ca
            for w in kube.get_json("validatingwebhookconfiguration", f"rlfleet-{ns}")["webhooks"]
        ),
        timeout=120,
    )
    assert len(configuration["webhooks"]) == 4
    kube.kubectl("apply", "-n", ns, "-f", "-", input=_suspended_job("ab", "cd-ef"))
    try:
        wait_for(
            "SamplerGroup ab-cd-ef", lambda: kube.get_json("samplergroup", "ab-cd-ef", "-n", ns), timeout=120
        )
        colliding = _suspended_job("ab-cd", "ef")
        # failurePolicy Ignore admits while the webhook is not serving yet: a server-side dry run (admission
        # runs, nothing is stored) until it answers, then the real apply
        denied = wait_for(
            "the webhook refusing the colliding job (dry run)",
            lambda: (
                (
                    r := kube.kubectl(
                        "apply", "--dry-run=server", "-n", ns, "-f", "-", input=colliding, check=False
                    )
                ).returncode
                != 0
                and r.stderr
            ),
            timeout=180,
        )
        assert "denied the request" in denied and "RLJob ab" in denied and "ab-cd-ef" in denied, denied
        applied = kube.kubectl("apply", "-n", ns, "-f", "-", input=colliding, check=False)
        assert applied.returncode != 0 and "denied the request" in applied.stderr, (
            applied.stdout + applied.stderr
        )
        missing = kube.kubectl("get", "rljob", "ab-cd", "-n", ns, check=False)
        assert missing.returncode != 0 and "NotFound" in missing.stderr
    finally:
        kube.kubectl("delete", "rljob", "ab", "-n", ns, "--wait=true", "--timeout=120s", check=False)


def assert_no_rollout_lost_or_doubled(fleet: Any, drops_before: int, through_step: int) -> None:
    """No rollout lost (the trainer's driver dropped no prompt group since it had dropped `drops_before`)
    or counted twice: every step up to at least `through_step` trained exactly the example's promptsPerStep
    x samplesPerPrompt (8 x 4) episodes."""
    assert fleet.logs(f"{JOB}-trainer-0", "trainer").count(" dropped: ") == drops_before
    from rlfleet.trainer.publish import checkpoint

    history = checkpoint.load_latest(fleet.store_dir() / "checkpoints")["history"]
    episodes = {
        int(row["step"]): sum(v for k, v in row.items() if k.startswith("group/") and k.endswith("/episodes"))
        for row in history
    }
    assert len(episodes) >= through_step + 1 and set(episodes.values()) == {8 * 4}, episodes


def test_a_deleted_sampler_pod_is_replaced_from_the_newest_version(fleet: Fleet) -> None:
    """The replacement's init container fetches and verifies the channel's newest version (not version
    0), a delta version: seeded from its anchor plus every delta after it (issue 40 item 7), reading exactly
    the anchor's view and those payloads; its sidecar goes on from that copy. The deleted pod's subscriber
    report is gone (its sidecar withdrew it on SIGTERM); training goes on."""
    [old] = fleet.sampler_pods("bf16")
    old_name = old["metadata"]["name"]
    report = fleet.store_dir() / "subscribers" / f"{JOB}-bf16" / f"{old_name}.json"
    assert report.exists(), sorted(p.name for p in report.parent.glob("*"))

    def just_past_an_anchor() -> int | None:  # deleted then, the pod is back before the next anchor
        latest = fleet.latest_version()
        return (
            latest
            if latest in fleet.manifests and 1 <= _since_anchor(fleet.manifests, "bf16", latest) <= 2
            else None
        )

    latest = wait_for(
        "a bf16 delta version just past an anchor", just_past_an_anchor, timeout=600, interval=0.2
    )
    step = fleet.step()
    drops_before = fleet.logs(f"{JOB}-trainer-0", "trainer").count(" dropped: ")
    fleet.kube.kubectl("delete", "pod", "-n", fleet.ns, old_name, "--wait=true", "--timeout=120s")
    assert not report.exists()  # withdrawn by the stopping sidecar, not aged out

    def replacement() -> dict[str, Any] | None:
        pods = [p for p in fleet.sampler_pods("bf16") if p["metadata"]["name"] != old_name]
        return pods[0] if pods and ready(pods[0]) else None

    new = wait_for("the replacement bf16 pod Ready", replacement, timeout=600)
    # credentials per role (docs/weights.md): the sync side reads the channel and writes only its group's
    # reports; a write anywhere else in the store is refused by the read-only mount
    probe = (
        "import errno, os\n"
        f"root = {STORE_PATH!r}\n"
        "for path in (root + '/planted', root + '/pointer.json', root + '/subscribers/other-group-planted'):\n"
        "    try:\n"
        "        open(path, 'a').close()\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('REFUSED', errno.errorcode[exc.errno], path)\n"
        f"mine = root + '/subscribers/{JOB}-bf16/probe'\n"
        "open(mine, 'w').close(); os.remove(mine); print('REPORTS-WRITABLE')\n"
    )
    exec_out = fleet.kube.kubectl(
        "exec",
        "-n",
        fleet.ns,
        new["metadata"]["name"],
        "-c",
        "weight-sync",
        "--",
        "python3",
        "-I",
        "-c",
        probe,
    ).stdout
    assert exec_out.count("REFUSED EROFS") == 3 and "WROTE" not in exec_out, exec_out
    assert "REPORTS-WRITABLE" in exec_out, exec_out
    fetched = fleet.logs(new["metadata"]["name"], "weight-fetch")
    [launched] = _obtained(fetched, LAUNCHED)
    assert launched.version >= latest, fetched[-3000:]
    assert fleet.manifests[launched.version].views["bf16"].delta is not None, (
        f"v{launched.version}, the newest version when the replacement started, is an anchor: the pod took "
        f"{ANCHOR_EVERY - 2} versions or more to come back; nothing seeded from deltas"
    )
    seeded = _expected(fleet.manifests, "bf16", launched.version, set())
    assert launched == seeded and launched.source.startswith("anchor v") and launched.read["delta"] > 0, (
        launched
    )
    # the sidecar goes on from the seeded copy (a delta on it, or the next anchor downloaded)
    new_name = new["metadata"]["name"]
    [first, *_] = wait_for(
        "the replacement's sidecar applying a version",
        lambda: _obtained(fleet.logs(new_name, "weight-sync"), APPLIED),
        timeout=600,
    )
    # built on a copy this pod holds verified (the seeded one, or one its sidecar rebuilt since: one node run
    # saw 'local v373 + delta v374' first with a launch below v373) or on the next anchor, read exactly as the
    # manifests say from there
    held = _copy_version(first) if first.source.startswith("local v") else launched.version
    assert held >= launched.version and first == _expected(fleet.manifests, "bf16", first.version, {held}), (
        first
    )
    fleet.wait_step(step + 2)
    assert (fleet.store_dir() / "subscribers" / f"{JOB}-bf16" / f"{new['metadata']['name']}.json").exists()
    # no rollout lost (the router moved the deleted pod's requests: the driver dropped no prompt group)
    # or counted twice (every step trained exactly promptsPerStep x samplesPerPrompt episodes)
    assert_no_rollout_lost_or_doubled(fleet, drops_before, step)


def test_a_spot_reclaimed_sampler_pod_loses_no_episode(fleet: Fleet, dev_cluster) -> None:
    """A spot reclaim past its notice: every process of the fp8 sampler pod is SIGKILLed on the node
    (containerd kills its tasks: no SIGTERM, no sidecar withdrawal, in-flight turns cut mid-answer) and the
    pod is force-deleted, as when its VM is gone. The router's failed attempts on it are retried elsewhere
    (docs/router.md), the driver drops no prompt group, every step trains promptsPerStep x
    samplesPerPrompt episodes, and the Deployment's replacement serves again."""
    [old] = fleet.sampler_pods("fp8")
    old_name = old["metadata"]["name"]
    step = fleet.step()
    fleet.wait_step(step + 1)  # the fleet is generating: the group has turns in flight
    drops_before = fleet.logs(f"{JOB}-trainer-0", "trainer").count(" dropped: ")
    container_ids = [c["containerID"].split("://", 1)[1] for c in old["status"]["containerStatuses"]]
    for container_id in container_ids:
        dev_cluster.node.ctr("tasks", "kill", "-s", "SIGKILL", container_id)
    fleet.kube.kubectl(
        "delete", "pod", "-n", fleet.ns, old_name, "--grace-period=0", "--force", "--wait=false"
    )

    def replacement() -> dict[str, Any] | None:
        pods = [p for p in fleet.sampler_pods("fp8") if p["metadata"]["name"] != old_name]
        return pods[0] if pods and ready(pods[0]) else None

    wait_for("the replacement fp8 pod Ready", replacement, timeout=600)
    killed = fleet.step()
    fleet.wait_step(killed + 2)
    assert_no_rollout_lost_or_doubled(fleet, drops_before, killed)
    from rlfleet.trainer.publish import checkpoint

    def fp8_trains_again() -> float | None:  # the replacement serves: fp8 episodes in a step after the kill
        rows = checkpoint.load_latest(fleet.store_dir() / "checkpoints")["history"]
        after = sum(
            v
            for row in rows
            if int(row["step"]) > killed
            for k, v in row.items()
            if k.startswith("group/") and k.endswith("fp8/episodes")
        )
        return after or None

    wait_for("the fp8 group's episodes trained again", fp8_trains_again, timeout=600)


def test_training_goes_on_without_the_operator_and_status_converges(fleet: Fleet) -> None:
    [op] = fleet.pods("app.kubernetes.io/name=rlfleet")
    step = fleet.step()
    fleet.kube.kubectl(
        "delete", "pod", "-n", fleet.ns, op["metadata"]["name"], "--wait=true", "--timeout=120s"
    )
    # the trainer and the samplers do not need the operator: the channel moves on while it is gone
    version = fleet.latest_version() or 0
    wait_for(
        "a new version published while the operator restarts",
        lambda: (fleet.latest_version() or 0) > version,
        timeout=600,
    )
    wait_for(
        "the new operator pod Ready",
        lambda: any(ready(p) for p in fleet.pods("app.kubernetes.io/name=rlfleet")),
        timeout=300,
    )
    fleet.wait_step(step + 2)  # the new operator reads the trainer and writes the status again


def test_a_corrupted_view_is_refused_and_the_group_keeps_serving(fleet: Fleet) -> None:
    """A byte flipped in the nvfp4 view of new versions as they land (before the pointer moves): the
    nvfp4 sidecar refuses one by checksum, keeps serving the version it has, and says why; the other
    groups apply it. The sidecar syncs to the newest version it sees, so on a fast node a version can be
    skipped: every landing version is flipped until the sidecar has refused one. The flipped file is the
    view's delta payload (`model.safetensors.delta`) or, for an anchor, its `model.safetensors`. Every
    later nvfp4 version is built on the refused one until the next anchor: the sidecar comes back by
    downloading that anchor (issue 40 item 4)."""
    store = fleet.store_dir()
    # the counts are cumulative over the pods' lives (an earlier test replaced a pod): this test's
    # refusals are what it adds
    failures_before = {g: _sync_failures(fleet, g) for g in ("bf16", "nvfp4")}
    [pod] = fleet.sampler_pods("nvfp4")
    name = pod["metadata"]["name"]
    # the sidecar's line: "... v64/nvfp4/model.safetensors.delta: blake3:0375aa83bf8a.. (2260 B) != manifest blake3:..."
    refusal = re.compile(r"v(\d+)/nvfp4/model\.safetensors(?:\.delta)?: [^\n]*? != manifest")
    flipped: list[int] = []
    version = (fleet.latest_version() or 0) + 1
    deadline = time.monotonic() + 600
    while not (refused := refusal.search(fleet.logs(name, "weight-sync"))):
        assert time.monotonic() < deadline, f"no checksum refusal by the nvfp4 sidecar; flipped {flipped}"
        version = max(version, (fleet.latest_version() or 0) + 1)  # never behind the pointer
        view = store / f"v{version}" / "nvfp4"  # the channel's layout (docs/weights.md)
        if wait_for(
            f"version {version}'s nvfp4 payload or file",
            lambda d=view: (
                _flip_a_byte(d / "model.safetensors.delta") or _flip_a_byte(d / "model.safetensors")
            ),
            timeout=300,
            interval=0.02,
        ):
            flipped.append(version)
        version += 1
    target = int(refused.group(1))
    assert target in flipped, (target, flipped)
    applied = fleet.groups()[f"{JOB}-nvfp4"]["status"].get("appliedWeightVersion")
    assert applied is None or applied not in flipped
    assert ready(fleet.sampler_pods("nvfp4")[0])  # still serving
    wait_for(
        "bf16 past the corrupted version",
        lambda: (fleet.groups()[f"{JOB}-bf16"]["status"].get("appliedWeightVersion") or 0) >= target,
        timeout=600,
    )
    # the status counts the refusal (the reason is in the message and the WeightsSynced condition only
    # while the replica still fails: the next anchor clears it)
    wait_for(
        "the nvfp4 group's status counting the refusal",
        lambda: _sync_failures(fleet, "nvfp4") > failures_before["nvfp4"],
        timeout=300,
    )
    assert _sync_failures(fleet, "bf16") == failures_before["bf16"]  # bf16's files were not touched
    wait_for(
        "the nvfp4 group past the corrupted versions",
        lambda: (fleet.groups()[f"{JOB}-nvfp4"]["status"].get("appliedWeightVersion") or 0) > max(flipped),
        timeout=900,
    )
    [recovered, *_] = _obtained(fleet.logs(name, "weight-sync")[refused.start() :], APPLIED)
    assert recovered.source.startswith("anchor v") and int(recovered.source.split()[1][1:]) > target, (
        recovered
    )
    assert recovered == _expected(fleet.manifests, "nvfp4", recovered.version, set()), recovered


def _sync_failures(fleet: Fleet, group: str) -> int:
    return int(fleet.groups()[f"{JOB}-{group}"].get("status", {}).get("weightSyncFailures") or 0)


def _flip_a_byte(path: Path) -> bool:
    try:
        with path.open("r+b") as fh:
            fh.seek(-1, 2)
            last = fh.read(1)
            fh.seek(-1, 2)
            fh.write(bytes([last[0] ^ 0xFF]))
        return True
    except OSError:
        return False


def test_a_killed_trainer_resumes_at_its_checkpoint_and_versions_never_go_back(fleet: Fleet) -> None:
    before = fleet.latest_version()
    assert before is not None
    trainer = f"{JOB}-trainer-0"
    fleet.kube.kubectl("delete", "pod", "-n", fleet.ns, trainer, "--grace-period=0", "--force", "--wait=true")

    def resumed_log() -> (
        str | None
    ):  # the NEW pod's log (the old container may still publish once as it dies)
        got = fleet.kube.kubectl("logs", "-n", fleet.ns, trainer, "-c", "trainer", check=False)
        return (
            got.stdout
            if got.returncode == 0 and "resuming from the checkpoint at step" in got.stdout
            else None
        )

    log = wait_for("the restarted trainer resuming at its checkpoint", resumed_log, timeout=900)
    resumed = re.search(r"resuming from the checkpoint at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= before, log[-3000:]
    resumed_at = int(resumed.group(1))
    wait_for(
        "a new version from the restarted trainer",
        lambda: (fleet.latest_version() or 0) > max(before, resumed_at),
        timeout=900,
    )
    seen = fleet.versions_seen
    assert seen == sorted(seen), seen  # never backwards, across the kill


def _trainer_pids() -> list[int]:
    """The trainer pod's processes on this node (its launcher and both ranks): the kubelet sets HOSTNAME to the
    pod's name in its containers' environment."""
    wanted = f"HOSTNAME={JOB}-trainer-0".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if wanted in (d / "environ").read_bytes().split(b"\0"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one_above_the_pointer(fleet: Fleet) -> None:
    """issue 39 item 3 as a pod: the trainer is frozen (SIGSTOP on the node) at a moment its newest checkpoint
    is the pointer's version, that checkpoint's bytes are flipped, and the pod is killed. The restarted pod
    skips it, resumes from the previous one although the channel is ahead (before: exit 2, CrashLoopBackOff,
    'the weight channel is at version N, ahead of the trainer'), publishes above the pointer, and every
    version from then on records its step (version = step + offset)."""
    import os
    import signal

    from rlfleet.channel import WeightChannel
    from rlfleet.store import FilesystemStore
    from rlfleet.trainer.publish import checkpoint

    checkpoints = fleet.store_dir() / "checkpoints"
    channel = WeightChannel(FilesystemStore(fleet.store_dir()), publisher_id="test-observer")
    fleet.wait_step(fleet.step() + 1, timeout=900)  # training again after the previous phase

    def frozen_at_its_pointer() -> tuple[list[int], str, int] | None:
        pids = _trainer_pids()
        assert pids, "no trainer process on the node"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        entries = json.loads((checkpoints / "latest").read_text())["checkpoints"]
        newest = checkpoint.load_latest(checkpoints)
        pointer = channel.latest()
        if (
            len(entries) >= 2
            and newest is not None
            and pointer is not None
            and pointer.version == newest["step"] + int(newest.get("version_offset", 0))
        ):
            return pids, entries[-1]["name"], pointer.version
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        return None

    pids, damaged, pointer_at = wait_for(
        "the trainer frozen with its newest checkpoint published",
        frozen_at_its_pointer,
        timeout=300,
        interval=0.3,
    )
    step = checkpoint.parse_checkpoint_name(damaged)[0]
    data = bytearray((checkpoints / damaged).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (checkpoints / damaged).write_bytes(bytes(data))
    trainer = f"{JOB}-trainer-0"
    fleet.kube.kubectl("delete", "pod", "-n", fleet.ns, trainer, "--grace-period=0", "--force", "--wait=true")
    wait_for("the frozen trainer processes gone", lambda: not set(pids) & set(_trainer_pids()), timeout=120)

    def resumed_log() -> str | None:
        got = fleet.kube.kubectl("logs", "-n", fleet.ns, trainer, "-c", "trainer", check=False)
        return (
            got.stdout
            if got.returncode == 0 and "resuming from the checkpoint at step" in got.stdout
            else None
        )

    try:
        log = wait_for(
            "the restarted trainer resuming from the previous checkpoint", resumed_log, timeout=900
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{fleet.diagnosis()}") from None
    assert f"checkpoint {damaged} in " in log and "not loaded" in log, log[-3000:]
    assert f"resuming from the checkpoint at step {step - 1} " in log, log[-3000:]
    assert (
        f"the weight channel is at version {pointer_at}, ahead of the checkpoint of step {step - 1}" in log
        and f"publishing its weights as version {pointer_at + 1}" in log
    ), log[-3000:]
    wait_for(
        "versions above the pointer", lambda: (fleet.latest_version() or 0) >= pointer_at + 2, timeout=900
    )
    offset = pointer_at + 1 - (step - 1)
    for version in range(pointer_at + 1, (fleet.latest_version() or 0) + 1):
        if version in channel.versions():
            assert channel.manifest(version).metadata.get("step") == version - offset, version
    seen = fleet.versions_seen
    assert seen == sorted(seen), seen  # never backwards, across the fallback


def test_a_full_store_volume_stops_publishing_with_a_clear_reason_and_names_nothing_partial(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The store's volume filled from the node: the trainer's next checkpoint or publish fails, it exits
    with one line that the RLJob's status quotes (the container's termination message), the pointer
    still names a version whose every file verifies; with room again, training goes on."""
    from rlfleet.channel import WeightChannel
    from rlfleet.store import FilesystemStore

    store = fleet.store_dir()
    filler = store / "filler"  # root's file: nothing in the pods can remove it
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True, check=False
    )  # to ENOSPC
    try:
        # between the trainer's restarts (the kubelet's back-off) the RLJob is Degraded and quotes it
        try:
            status = wait_for(
                "the RLJob saying the store is full",
                lambda: "is full" in (s := fleet.status()).get("message", "") and s,
                timeout=900,
            )
        except AssertionError as exc:  # say what the job, the trainer and the operator said instead
            raise AssertionError(f"{exc}\n{fleet.diagnosis()}") from None
        why = status["message"]
        assert "No space left on device" in why and status["phase"] == "Degraded", status
        assert (
            status["reason"] == "CrashLoopBackOff" and "it said: rlfleet trainer run: the weight store" in why
        )
        assert "Fix: free space on its volume or grow it" in why, why
        assert "code 3;" in why, why  # the store-full class's own exit code (rlfleet trainer launch), not 1
        latest = fleet.latest_version()
        assert latest is not None
        channel = WeightChannel(FilesystemStore(store))
        for view in GROUPS:  # every file of the named version is there, with its digest (verified)
            channel.obtain_view(latest, view, tmp_path / view)
    finally:
        filler.unlink()
    wait_for("a new version once there is room", lambda: (fleet.latest_version() or 0) > latest, timeout=900)


def test_twenty_steps_then_deleting_the_rljob_leaves_no_pod(fleet: Fleet) -> None:
    fleet.wait_step(20, timeout=1500)
    fleet.kube.kubectl("delete", "rljob", JOB, "-n", fleet.ns, "--wait=true", "--timeout=300s")
    wait_for("no pod of the job left", lambda: not fleet.pods(f"rlfleet.dev/job={JOB}"), timeout=300)
