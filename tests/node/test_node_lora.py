"""The LoRA example fleet on the real node (issue 42 item 5): `helm install` of charts/rlfleet, then
`kubectl apply -f examples/rljob-lora.yaml` as users apply it (its PVC on the dev cluster's default
StorageClass): a torch-backend trainer on two gloo ranks training a PEFT adapter of the frozen tiny Qwen3,
three `cpu` sampler groups (bf16, fp8 with an fp8 KV cache, nvfp4) that launch their engines from their
BASE view and load every version's adapter at run time (docs/weights.md, docs/sampler.md and
docs/router.md, "LoRA"). What the pods and the store show:

- the channel: the base views stored once, at version 0 (the WeightChannel's `loraBase`), and every
  later version only the `lora` view, a few hundred KB at most beside the base views' bytes;
- each group's sidecar applies adapter after adapter ("applied weights vN (lora)"), its engine holds at
  most two rlfleet adapters (the newest and the one before: `/v1/models`, read inside the pod with the
  job's key), and no sampler container ever restarts: versions swap without a restart;
- the trainer's rollouts come from every group with tokens of adapter versions >= 1 (its step history:
  per-group episodes, the step's oldest token version from its staleness), and `kubectl get sg`'s VERSION
  is an adapter version the group's sidecar applied;
- a deleted sampler pod comes back on its base (v0) and loads the newest adapter; no version is
  published twice and no base is stored again.

The tests share one fleet (module scope) and run in file order, as test_node_fleet.py's do. The file sorts
before test_node_pods.py, whose last test stops the node (the conftest moves it last anyway).
"""

from __future__ import annotations

import hashlib
import re
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

from rlfleet.channel import Manifest
from rlfleet.lora import LORA_VIEW, adapter_version
from rlfleet.operator import naming

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-lora.yaml"
JOB = "lora"  # metadata.name in the example
GROUPS = ("bf16", "fp8", "nvfp4")
CLAIM = "rlfleet-lora-weights"
STORE_PATH = "/weights/lora"
# The one change to the example: more steps. Its 50 steps take a few minutes here, and the phases below
# (several adapter swaps per group, then a sampler pod deleted and replaced) need a run that is still
# training; the fixture deletes the job at the end. The learning rate, the rank and the groups are the
# example's.
TOTAL_STEPS = 2000
ADAPTER_BYTES_AT_MOST = 400_000  # rank 16 on 7 projections of the tiny model: 143.2 KB (the local run)
MIN_APPLIED = 3  # adapter versions each sidecar must have applied


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
    digests: dict[int, str] = field(default_factory=dict)  # sha256 of each manifest.json as first read

    def keep_manifest(self, version: int, raw: bytes, manifest: Manifest) -> None:
        """The manifest and the digest of its bytes (a version published twice would show another manifest
        under the same number)."""
        self.digests[version] = hashlib.sha256(raw).hexdigest()
        self.manifests[version] = manifest

    def applied(self, pod: str) -> list[int]:
        """The adapter versions the pod's sidecar applied, in order (its log line per version)."""
        return [int(m.group(1)) for m in APPLIED.finditer(self.logs(pod, "weight-sync"))]


# The sidecar's line per version it applied (sampler/syncer.py): with LoRA the followed view is `lora`.
APPLIED = re.compile(r"applied weights v(\d+) \(" + LORA_VIEW + r"\) from ")
# The init container's line (sampler/syncer.py fetch_for_launch): the base view the engine launches from.
LAUNCHED = re.compile(r"launch checkpoint: v(\d+) \((\w+)\) at \S+, from (.+?), (\d+) bytes read")
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
    "models = get(engine + '/v1/models', auth=True)\n"
    "after = get(sidecar + '/status')\n"
    "print(json.dumps({'before': before, 'models': models, 'after': after}))\n"
)


def _restarts(pod: dict[str, Any]) -> dict[str, int]:
    statuses = pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", [])
    return {c["name"]: int(c.get("restartCount", 0)) for c in statuses}


def _adapters(models: dict[str, Any]) -> list[int]:
    """The rlfleet adapters an engine's /v1/models lists (cards with a parent named v<N>)."""
    return sorted(
        v
        for card in models.get("data") or []
        if card.get("parent") and (v := adapter_version(str(card.get("id")))) is not None
    )


@pytest.fixture(scope="module")
def fleet(dev_cluster) -> Iterator[Fleet]:
    kube = dev_cluster.kube
    ns = f"lora-{uuid.uuid4().hex[:6]}"
    install_operator_reading_claim(
        kube, dev_cluster.images["operator"].ref, ns, store="lora", claim=CLAIM, mount_path=STORE_PATH
    )
    docs, job = example_rljob(EXAMPLE)
    assert job["metadata"]["name"] == JOB and job["spec"]["trainer"]["lora"]["rank"] == 16
    job["spec"]["trainer"]["totalSteps"] = TOTAL_STEPS  # the run must outlast the phases (above)
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
    fleet = Fleet(kube, ns, time.monotonic())
    try:
        with watching_versions(fleet, on_version=fleet.read_new_manifests):
            yield fleet
    finally:
        delete_job_and_operator(kube, ns)


def test_the_trainer_publishes_adapters_over_bases_stored_once(fleet: Fleet) -> None:
    """The torch backend on two gloo ranks trains the PEFT adapter only; version 0 holds the three base
    views and the adapter, every later version only the adapter (a few hundred KB) naming its bases at
    version 0; the WeightChannel's status says so (`loraBase`, the latest artifacts)."""
    step = fleet.wait_step(2, timeout=1500)
    print(f"step {step} after {time.monotonic() - fleet.started:.0f}s from apply")
    trainer = fleet.kube.get_json("pod", f"{JOB}-trainer-0", "-n", fleet.ns)
    [container] = [c for c in trainer["spec"]["containers"] if c["name"] == "trainer"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("NPROC_PER_NODE") == "2", env  # torchrun --nproc-per-node=$(NPROC_PER_NODE): 2 gloo ranks
    log = fleet.logs(f"{JOB}-trainer-0", "trainer")
    trained = re.search(r"LoRA: (\d+) of (\d+) parameters trained", log)
    # the adapter only (rank 16 on 7 projections of a model this small: 69632 of 414592, 16.8%)
    assert trained and 0 < int(trained.group(1)) < int(trained.group(2)) // 4, log[-3000:]
    # the image's torch measured whether gloo's reduce-scatter averages (Debian's torch 2.6 sums: the
    # gradients' scale follows it, tests/trainer/test_trainer_backend_hf.py checks both ways)
    reduce = re.search(
        r"FSDP2 over 2 gloo ranks \(torch (\S+)\): the gradient reduce-scatter (averages|sums)", log
    )
    assert reduce, log[-3000:]
    print(f"trainer image torch {reduce.group(1)}: the reduce-scatter {reduce.group(2)}")

    def channel_status() -> dict[str, Any] | None:
        status = fleet.kube.get_json("weightchannels", "-n", fleet.ns)["items"][0].get("status", {})
        artifacts = status.get("artifacts") or []
        ok = (status.get("latestVersion") or 0) >= 2 and [a["view"] for a in artifacts] == [LORA_VIEW]
        return status if ok and status.get("loraBase") else None

    status = fleet.wait("the WeightChannel naming a LoRA version and its bases", channel_status, timeout=600)
    assert status["loraBase"] == {"bf16": 0, "fp8": 0, "nvfp4": 0}, status
    [artifact] = status["artifacts"]
    assert 0 < artifact["bytes"] <= ADAPTER_BYTES_AT_MOST, artifact
    fleet.wait("the manifests of versions 0 to 2", lambda: {0, 1, 2} <= set(fleet.manifests), timeout=120)
    v0 = fleet.manifests[0]
    assert set(v0.views) == {*GROUPS, LORA_VIEW}, sorted(v0.views)
    base_bytes = {view: v0.views[view].bytes for view in GROUPS}
    for version, manifest in sorted(fleet.manifests.items()):
        assert manifest.metadata.get("lora_base") == {"bf16": 0, "fp8": 0, "nvfp4": 0}, (
            version,
            manifest.metadata,
        )
        if version == 0:
            continue
        assert set(manifest.views) == {LORA_VIEW}, (version, sorted(manifest.views))
        lora = manifest.views[LORA_VIEW]
        assert lora.delta is None and 0 < lora.bytes <= ADAPTER_BYTES_AT_MOST, (version, lora.bytes)
        # below every base view (the smallest, nvfp4, is 231 KB here) and a fifth of full fine-tuning's
        # version (the three views: 1.30 MB) at most
        assert lora.bytes < min(base_bytes.values()), (version, lora.bytes, base_bytes)
        assert lora.bytes * 5 < sum(base_bytes.values()), (version, lora.bytes, base_bytes)
    print(
        f"adapter {artifact['bytes']} B per version; base views stored once at v0: {base_bytes} "
        f"({sum(base_bytes.values()) / artifact['bytes']:.1f}x the adapter); {len(fleet.manifests)} versions read"
    )
    print(fleet.kube.kubectl("get", "wc", "-n", fleet.ns).stdout)


def test_every_group_swaps_adapters_without_a_restart(fleet: Fleet) -> None:
    """Each group's sidecar applies several adapter versions; its engine lists at most two rlfleet adapters,
    the one the sidecar applied last and the one before; no container of a sampler pod ever restarted."""
    for group in GROUPS:
        [pod] = fleet.sampler_pods(group)
        name = pod["metadata"]["name"]
        applied = fleet.wait(
            f"the {group} sidecar applying {MIN_APPLIED} adapter versions",
            lambda n=name: a if len(a := fleet.applied(n)) >= MIN_APPLIED else None,
            timeout=900,
        )
        assert applied == sorted(set(applied)), (group, applied)  # each once, forwards

        three: list[list[int]] = []  # in-sync snapshots holding more than 2 adapters (retried; reported)

        def settled(n: str = name, three: list[list[int]] = three) -> tuple[dict[str, Any], list[int]] | None:
            got = fleet.probe(n, ENGINE_PROBE)
            before, after = got["before"], got["after"]
            if not (
                before["phase"] == after["phase"] == "in-sync"
                and before["applied_version"] == after["applied_version"]
            ):
                return None
            if len(_adapters(got["models"])) > 2:
                # SGLang (and the reference engine) load an unloaded adapter again for a late request that
                # names it (docs/sampler.md, "LoRA"); the sidecar's next apply unloads it: not a settled state
                three.append(_adapters(got["models"]))
                return None
            # the log read after: a version applied since is left out
            return got, [v for v in fleet.applied(n) if v <= after["applied_version"]]

        got, lines = fleet.wait(
            f"the {group} sidecar in sync with its engine holding at most 2 adapters (seen with more: {three})",
            settled,
            timeout=300,
            interval=0.2,
        )
        serving = got["after"]["applied_version"]
        held = _adapters(got["models"])
        print(
            f"{group}: applied {lines[:3]}..{lines[-3:]} ({len(lines)}), engine holds {held}; "
            f"in-sync snapshots with more than 2 adapters before: {three}"
        )
        assert serving == lines[-1] and serving >= 1, (group, serving, lines)
        assert held[-1:] == [serving] and len(held) <= 2, (group, held, serving)
        if len(held) == 2:  # the one before: what the sidecar applied before it
            assert held[0] == lines[-2], (group, held, lines[-3:])
        assert got["after"]["failures"].get("checksum", 0) == 0, got["after"]
    for group in GROUPS:
        for pod in fleet.sampler_pods(group):
            assert set(_restarts(pod).values()) == {0}, (pod["metadata"]["name"], _restarts(pod))


def test_rollouts_come_from_every_group_on_adapter_versions(fleet: Fleet) -> None:
    """The trainer's steps since every group applied an adapter: each group's episodes trained, in steps
    whose every token came from an adapter version >= 1 (the step's oldest token version is the version
    the trainer held minus its staleness_max); the cockpit's VERSION per group is an adapter version its
    sidecar applied."""

    def adapter_steps() -> dict[str, float] | None:
        episodes = dict.fromkeys(GROUPS, 0.0)
        for row in fleet.history():
            held = int(row["weight_version"]) - 1  # the version the trainer held while it took the step
            if held - int(row.get("staleness_max", 0)) < 1 or not row.get("trained_tokens"):
                continue  # a token of that step may be from version 0 (the untrained adapter)
            for group in GROUPS:
                episodes[group] += float(row.get(f"group/{JOB}-{group}/episodes", 0.0)) + float(
                    row.get(f"group/{group}/episodes", 0.0)
                )
        return episodes if all(episodes.values()) else None

    try:
        episodes = fleet.wait("every group's episodes in steps on adapters >= v1", adapter_steps, timeout=900)
    except AssertionError:
        rows = fleet.history()
        raise AssertionError(
            f"no step on adapters >= v1 from every group; the last rows: {rows[-3:]}"
        ) from None
    print(f"episodes trained on adapter versions >= 1, per group: {episodes}")

    # `kubectl get sg`'s VERSION column is the CRD's printer column of status.appliedWeightVersion, read here
    # from the objects (the table's empty cells do not split into columns)
    crd = fleet.kube.get_json("crd", "samplergroups.rlfleet.dev")
    [served] = [v for v in crd["spec"]["versions"] if v.get("served")]
    columns = {c["name"]: c["jsonPath"] for c in served["additionalPrinterColumns"]}
    assert columns["Version"] == ".status.appliedWeightVersion", columns

    versions = fleet.wait(
        "`kubectl get sg` with a VERSION >= 1 for every group",
        lambda: fleet.served_versions(GROUPS),
        timeout=600,
    )
    print(fleet.kube.kubectl("get", "samplergroups", "-n", fleet.ns).stdout)
    for group, version in versions.items():
        [pod] = fleet.sampler_pods(group)
        applied = fleet.applied(pod["metadata"]["name"])
        assert version in applied, (group, version, applied)


def test_a_deleted_sampler_pod_comes_back_on_its_base_and_the_newest_adapter(fleet: Fleet) -> None:
    """The bf16 pod deleted mid-run: its replacement's init container fetches the base view of version 0
    (the only version holding it), its engine launches from it, its sidecar loads the channel's newest
    adapter (not every version since 0), and the trainer trains on; the channel never publishes a version
    twice nor stores a base again."""
    [old] = fleet.sampler_pods("bf16")
    old_name = old["metadata"]["name"]
    fleet.wait_step(fleet.step() + 1)  # the fleet is generating
    latest = fleet.latest_version()
    assert latest is not None and latest >= 1
    step = fleet.step()
    fleet.kube.kubectl("delete", "pod", "-n", fleet.ns, old_name, "--wait=true", "--timeout=120s")

    def replacement() -> dict[str, Any] | None:
        pods = [p for p in fleet.sampler_pods("bf16") if p["metadata"]["name"] != old_name]
        return pods[0] if pods and ready(pods[0]) else None

    new = fleet.wait("the replacement bf16 pod Ready", replacement, timeout=600)
    name = new["metadata"]["name"]
    fetched = fleet.logs(name, "weight-fetch")
    launched = LAUNCHED.search(fetched)
    assert launched, fetched[-3000:]
    # "anchor v0", or "anchor v0 in place" where the engine reads the channel's own directory
    assert (int(launched.group(1)), launched.group(2)) == (0, "bf16"), launched.group(0)
    assert launched.group(3).startswith("anchor v0"), launched.group(0)
    applied = fleet.wait(
        "the replacement's sidecar applying an adapter", lambda: fleet.applied(name), timeout=600
    )
    assert applied[0] >= latest, (applied, latest)  # the newest adapter, not v1, v2, ...
    got = fleet.wait(
        "the replacement's engine holding the adapter its sidecar applied",
        lambda: (
            (g := fleet.probe(name, ENGINE_PROBE))["after"]["phase"] == "in-sync"
            and _adapters(g["models"])
            and g
        ),
        timeout=300,
    )
    held = _adapters(got["models"])
    assert len(held) <= 2 and held[-1] >= applied[0], (held, applied)
    fleet.wait_step(step + 2)

    def bf16_trains_again() -> float | None:  # the replacement serves: bf16 episodes in a step after it
        after = sum(
            v
            for row in fleet.history()
            if int(row["step"]) > step
            for k, v in row.items()
            if k.startswith("group/") and k.endswith("bf16/episodes")
        )
        return after or None

    fleet.wait("the bf16 group's episodes trained again", bf16_trains_again, timeout=600)
    [new] = [p for p in fleet.sampler_pods("bf16") if p["metadata"]["name"] == name]
    assert set(_restarts(new).values()) == {0}, _restarts(new)
    # no version published twice: the pointer only moved forwards, and every manifest still in the store
    # is the one read when it landed; no base view stored after version 0
    seen = fleet.versions_seen
    assert seen == sorted(set(seen)), seen
    for version, digest in sorted(fleet.digests.items()):
        try:
            raw = (fleet.store_dir() / f"v{version}" / "manifest.json").read_bytes()
        except OSError:
            continue  # retention removed it
        assert hashlib.sha256(raw).hexdigest() == digest, f"v{version}'s manifest changed since it landed"
    again = {v: sorted(m.views) for v, m in fleet.manifests.items() if v > 0 and set(m.views) != {LORA_VIEW}}
    assert not again, again
    [wc] = fleet.kube.get_json("weightchannels", "-n", fleet.ns)["items"]
    assert wc["status"]["loraBase"] == {"bf16": 0, "fp8": 0, "nvfp4": 0}, wc["status"]
