"""slime as the trainer, on the real node (issue 43 item 5, docs/slime.md): `helm install` of charts/rlfleet,
then `kubectl apply -f examples/rljob-slime.yaml` as users apply it (its router's shares static and equal,
so that slime's few requests reach every group: STATIC_SHARES says why): no training pods, the
trainer StatefulSet's one CPU pod running `rlfleet slime bridge --config ...`, three `cpu` sampler groups
(bf16, fp8 with an fp8 KV cache, nvfp4) behind the router, slime's publish directory on its own claim
`slime-updates`.

The test plays slime from the host:
- slime's trainer: tests/support/slime_publisher.py `SlimeStandIn` writes `weight_v{N:06d}/` directories
  (deltas, xor and overwrite, and full checkpoints, as slime's code writes them) straight into the
  `slime-updates` volume's directory on the node (a local-path PV: a directory of the host), from a base
  checkpoint built here with rlfleet.tiny_qwen3 exactly as `builtin:tiny-qwen3` is built (its bytes are
  checked against the bridge pod's own copy: slime's first delta applies to them);
- slime's rollouts: `slime_post` (slime's POST helper's retry semantics, tests/support/slime_requests.py)
  to the router's Service with the request hook's `"weight_version": {"exact_version": N}` and the job's
  key (its Secret), several sessions per version, until every group has answered.

What the pods and the store show: the bridge publishes version 0 and then each version slime writes, in
order, once; each exact_version request is answered at that version by every group; the WeightChannel's
latestVersion, the RLJob's externalVersion / weightVersion and each SamplerGroup's VERSION follow; a
malformed directory (a flipped byte in a delta) is refused by the bridge with one log line, nothing of it
published (externalVersion ahead of weightVersion meanwhile), and the next FULL version publishes.

The tests share one fleet (module scope) and run in file order, as test_node_fleet.py's do. The file sorts
before test_node_pods.py, whose last test stops the node (the conftest moves it last anyway).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from support import slime_publisher as publisher
from support.node_job import NodeJob, delete_job_and_operator, example_rljob, ready, watching_versions
from support.operator_chart import install_operator_reading_claim
from support.slime_publisher import SlimeStandIn
from support.slime_requests import rollout_meta, rollout_payload, slime_post
from support.waits import wait_for

from rlfleet.operator import naming

pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "rljob-slime.yaml"
JOB = "slime"  # metadata.name in the example
GROUPS = ("bf16", "fp8", "nvfp4")
CLAIM = "slime-weights"  # the weight channel's claim (the operator mounts it too)
UPDATES_CLAIM = "slime-updates"  # slime's --update-weight-disk-dir, mounted read-only into the bridge pod
STORE_PATH = "/weights/slime"
PUBLISH_DIR = "/slime/updates"  # trainer.external.publishDir: /slime is the updates claim's mount
BRIDGE = f"{JOB}-trainer-0"
# The versions slime writes (after the bridge's version 0), each asked exactly before the next is written
# (a group syncs to the newest version it sees: a version written before the last one was served may be
# skipped, and slime's exact_version for it would never be answered). MALFORMED: a delta with a flipped
# byte, refused; the full version after it publishes and the delta after that applies to it.
PLAN: tuple[tuple[str, str, str], ...] = (  # (kind, delta encoding, checksum)
    ("delta", "xor", "xxh3-128"),
    ("delta", "overwrite", "xxh3-128"),
    ("full", "", ""),
    ("delta", "xor", "adler32"),
    ("delta", "overwrite", "xxh3-128"),
    ("delta", "xor", "xxh3-128"),
)
MALFORMED = len(PLAN) + 1  # version 7
AFTER_MALFORMED: tuple[tuple[str, str, str], ...] = (("full", "", ""), ("delta", "overwrite", "xxh3-128"))
LAST = MALFORMED + len(AFTER_MALFORMED)  # version 9
# The example's router shares are static and equal (its comment says why): under the throughput policy a
# cpu group's share follows only what its share sent it, and a group without a ready replica at a rebalance
# drops to 0 and climbs back from the 0.02 floor: a run with that policy saw the nvfp4 group get none of 30
# sessions of v1. slime's requests must reach every group (each asks its version of every precision).
STATIC_SHARES = {"policy": "static", "staticShares": dict.fromkeys(GROUPS, 1)}
SHARE_PERCENT_AT_LEAST = 25  # each group's Share% before slime's first version (a third, once settled)
SESSIONS = 6  # per batch of one version's requests; batches until every group has answered (at most 10)
# slime's POST helper: retries any non-2xx (the router's 409 while the session's group does not serve the
# version yet). Its defaults are 60 x 1 s; the request hook may set both: more and shorter here, so that a
# group loading a version on 2 loaded cores (CI) is waited for, and the wait ends soon after the load.
MAX_RETRIES, RETRY_SLEEP = 1200, 0.5
# The bridge pod's probes (`kubectl exec`, python3 -I): the base checkpoint the bridge resolves from
# `builtin:tiny-qwen3` (its model cache: HF_HOME), as per-tensor digests; the trainer image's slime
# dependencies; the bridge's own metrics.
BASE_DIGESTS = (
    "import hashlib, json\n"
    "from rlfleet.model_source import resolve_model_source\n"
    "from rlfleet.slime_publish import read_base\n"
    "base = read_base(resolve_model_source('builtin:tiny-qwen3'))\n"
    "print(json.dumps({n: [t.dtype, list(t.shape), hashlib.sha256(t.data.tobytes()).hexdigest()]"
    " for n, t in sorted(base.items())}))\n"
)
DEPENDENCIES = (
    "import json, xxhash, zstandard\n"
    "print(json.dumps({'xxhash': xxhash.VERSION, 'zstandard': zstandard.__version__}))\n"
)
BRIDGE_METRICS = (
    "import urllib.request\n"
    f"print(urllib.request.urlopen('http://127.0.0.1:{naming.TRAINER_METRICS_PORT}/metrics', timeout=10)"
    ".read().decode())\n"
)
PUBLISHED = re.compile(r"published v(\d+) from (.+?): ")  # trainer/slime_bridge.py `_publish`
REFUSED = re.compile(r"v(\d+) not published: (.+)$", re.M)  # trainer/slime_bridge.py `_log_refused`


@dataclass
class Slime(NodeJob):
    job = JOB
    claim = CLAIM
    group_names = GROUPS
    kube: Any  # controlplane.KubeCluster
    ns: str
    started: float
    base: Path  # the base checkpoint, built on the host as builtin:tiny-qwen3 is
    versions_seen: list[int] = field(default_factory=list)  # the channel's pointer, polled
    answered: dict[int, dict[str, set[int]]] = field(default_factory=dict)  # version -> group -> versions
    stand_in: SlimeStandIn | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(43))
    _router: str | None = None
    _port_forward: subprocess.Popen | None = None

    # --- the cluster's objects --------------------------------------------------------------------
    def channel_status(self) -> dict[str, Any]:
        [wc] = self.kube.get_json("weightchannels", "-n", self.ns)["items"]
        return wc.get("status", {})

    def group_versions(self) -> dict[str, int | None]:
        items = self.kube.get_json("samplergroups", "-n", self.ns)["items"]
        return {
            sg["metadata"]["name"].removeprefix(f"{JOB}-"): sg.get("status", {}).get("appliedWeightVersion")
            for sg in items
        }

    def bridge_log(self) -> str:
        return self.logs(BRIDGE, "trainer")

    def published(self) -> list[int]:
        """The versions the bridge published, in its log's order (one line per version published)."""
        return [int(m.group(1)) for m in PUBLISHED.finditer(self.bridge_log())]

    def in_bridge(self, script: str) -> str:
        """Run `script` with the bridge pod's python (`kubectl exec`, the container's env: HF_HOME)."""
        return self.kube.kubectl(
            "exec", "-n", self.ns, BRIDGE, "-c", "trainer", "--", "python3", "-I", "-c", script
        ).stdout

    def bridge_metric(self, name: str) -> float | None:
        for line in self.in_bridge(BRIDGE_METRICS).splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return None

    # --- the router, from the host ------------------------------------------------------------------
    def router(self) -> str:
        """The router's URL from the host: its Service's cluster IP (kube-proxy's rules apply to the host's
        own connections, and the node's firewall lets the node in, as it does the kubelet's probes); a
        `kubectl port-forward` to the Service if the host cannot reach it."""
        if self._router:
            return self._router
        self.wait(
            "the router pod Ready",
            lambda: any(
                ready(p) for p in self.pods(f"rlfleet.dev/job={JOB},app.kubernetes.io/component=router")
            ),
            timeout=600,
            interval=2.0,
        )
        svc = self.kube.get_json("service", naming.router_name(JOB), "-n", self.ns)["spec"]
        [port] = [p["port"] for p in svc["ports"] if p.get("name") == "http"]
        url = f"http://{svc['clusterIP']}:{port}"
        try:
            wait_for("the router's /health at its cluster IP", lambda: _health(url), timeout=60)
        except AssertionError as exc:
            print(f"router not reachable at {url} from the host ({exc}); port-forward instead")
            url = self._forward(port)
        self._router = url
        return url

    def _forward(self, port: int) -> str:
        self._port_forward = subprocess.Popen(
            [str(self.kube.kubectl_bin), "port-forward", "-n", self.ns, f"service/{JOB}-router", f":{port}"],
            env=self.kube.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self._port_forward.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> 8000"
        m = re.search(r"127\.0\.0\.1:(\d+)", line)
        assert m, f"kubectl port-forward said {line!r}"
        url = f"http://127.0.0.1:{m.group(1)}"
        wait_for("the router's /health through port-forward", lambda: _health(url), timeout=60)
        return url

    # --- playing slime -----------------------------------------------------------------------------
    def publish_dir(self) -> Path:
        """publishDir as the host sees it: the updates claim's directory (mounted at /slime in the pod)."""
        return self.volume_dir(UPDATES_CLAIM) / Path(PUBLISH_DIR).relative_to("/slime")

    def write(self, kind: str, encoding: str, checksum_format: str) -> int:
        """slime's trainer writes its next version into the publish dir, as slime does (shards, then the
        index last); returns its number."""
        assert self.stand_in is not None
        new = self.stand_in.perturbed(self.rng)
        path = self.stand_in.publish(
            new, kind, encoding=encoding or "xor", checksum_format=checksum_format or "xxh3-128"
        )
        return int(path.name.removeprefix("weight_v"))

    async def ask(self, version: int) -> dict[str, set[int]]:
        """slime's rollouts of `version`: batches of SESSIONS sessions (slime's POST helper, the hook's
        exact_version and key), until every group has answered; group -> the versions its answers said."""
        headers = {"Authorization": f"Bearer {self.api_key()}"}
        url = self.router() + "/generate"
        got: dict[str, set[int]] = {}
        statuses: list[int] = []

        async def one(client: httpx.AsyncClient, session: str) -> None:
            output = await slime_post(
                client,
                url,
                rollout_payload(version),
                max_retries=MAX_RETRIES,
                retry_sleep=RETRY_SLEEP,
                statuses=statuses,
                headers={**headers, "X-SMG-Routing-Key": session},
            )
            meta = rollout_meta(output)
            group = str(meta["rlfleet_group"]).removeprefix(f"{JOB}-")
            got.setdefault(group, set()).add(int(meta["weight_version"]))

        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for batch in range(10):
                sessions = [f"slime-v{version}-{batch * SESSIONS + i}" for i in range(SESSIONS)]
                await asyncio.gather(*(one(client, s) for s in sessions))
                if set(got) >= set(GROUPS):
                    break
        waited = sum(1 for s in statuses if s == 409)
        print(f"v{version}: answered by {sorted(got)}; {waited} 409s while the groups loaded it")
        return got

    def stop(self) -> None:
        if self._port_forward is not None:
            self._port_forward.kill()
            self._port_forward.wait(timeout=10)

    # --- a failure's report ------------------------------------------------------------------------
    def diagnosis(self) -> str:
        parts = self.report_head()
        parts.append(f"bridge log tail:\n{self.log_tail(BRIDGE, 'trainer')}")
        parts += self.sampler_log_tails()
        for pod in self.pods(f"rlfleet.dev/job={JOB},app.kubernetes.io/component=router"):
            parts.append(f"router log tail:\n{self.log_tail(pod['metadata']['name'], None)}")
        for op in self.pods("app.kubernetes.io/name=rlfleet"):
            parts.append(f"operator log tail:\n{self.log_tail(op['metadata']['name'], None)}")
        return "\n".join(parts)

    def serve(self, version: int) -> None:
        """Ask `version` exactly until every group answered; every answer must be that version."""
        try:
            got = asyncio.run(self.ask(version))
        except Exception as exc:
            raise AssertionError(f"v{version}: slime's requests failed: {exc!r}\n{self.diagnosis()}") from exc
        self.answered[version] = got
        if set(got) != set(GROUPS):  # every group served the version
            raise AssertionError(f"v{version} answered only by {sorted(got)}\n{self.diagnosis()}")
        assert all(versions == {version} for versions in got.values()), (version, got)


def _health(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy of the host's env
    with opener.open(url + "/health", timeout=5) as response:
        return response.status == 200


def _base_digests(directory: Path) -> dict[str, list[Any]]:
    """BASE_DIGESTS' answer for a checkpoint directory on the host."""
    from rlfleet.slime_publish import read_base

    return {
        n: [t.dtype, list(t.shape), hashlib.sha256(t.data.tobytes()).hexdigest()]
        for n, t in sorted(read_base(directory).items())
    }


@pytest.fixture(scope="module")
def slime(dev_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slime]:
    from rlfleet.tiny_qwen3 import TinyQwen3, cached_tiny_qwen3

    kube = dev_cluster.kube
    ns = f"slime-{uuid.uuid4().hex[:6]}"
    # slime's --hf-checkpoint: builtin:tiny-qwen3 as rlfleet/model_source.py builds it (seed 0, no query)
    base = cached_tiny_qwen3(tmp_path_factory.mktemp("models"), TinyQwen3(seed=0))
    install_operator_reading_claim(
        kube, dev_cluster.images["operator"].ref, ns, store="slime", claim=CLAIM, mount_path=STORE_PATH
    )
    # the example as users apply it (its two PVCs with it), whose router shares are static and equal
    docs, job = example_rljob(EXAMPLE)
    assert job["metadata"]["name"] == JOB and job["spec"]["trainer"]["external"] == {
        "framework": "slime",
        "publishDir": PUBLISH_DIR,
    }
    assert {k: job["spec"]["router"].get(k) for k in STATIC_SHARES} == STATIC_SHARES, job["spec"]["router"]
    kube.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
    fleet = Slime(kube, ns, time.monotonic(), base)
    # slime's files readable by the bridge pod's uid 10001 (the stand-in writes as root): directories 0755
    # and the files it opens itself 0644 (umask 022), and each shard of a full version, which safetensors'
    # save_file writes 0600 (0.8: through a temporary file; the first run of this test saw the bridge
    # refuse v3 "Permission denied"), made 0644 as it is written, before the index (written last) makes
    # the version complete
    umask = os.umask(0o022)
    save_file = publisher.save_file

    def save_readable(tensors: Any, filename: str, metadata: dict[str, str] | None = None) -> None:
        save_file(tensors, filename, metadata=metadata)
        os.chmod(filename, 0o644)

    try:
        with watching_versions(fleet), pytest.MonkeyPatch.context() as patch:
            patch.setattr(publisher, "save_file", save_readable)
            yield fleet
    finally:
        os.umask(umask)
        fleet.stop()
        delete_job_and_operator(kube, ns)


def test_the_bridge_is_the_only_trainer_pod_and_publishes_version_0(slime: Slime) -> None:
    """No training pods: the trainer StatefulSet's one pod runs `rlfleet slime bridge --config ...` (CPU,
    the trainer image, which has slime's zstandard and xxhash), and it publishes version 0 of the three
    views from the job's model; its base checkpoint is the one slime's stand-in starts from, byte for
    byte; every group starts from version 0."""
    log = slime.wait(
        "the bridge publishing v0 from the base checkpoint",
        lambda: (text := slime.bridge_log()) and "published v0 from the base checkpoint" in text and text,
        timeout=900,
        interval=2.0,
    )
    print(f"v0 published {time.monotonic() - slime.started:.0f}s after apply")
    assert f"watching {PUBLISH_DIR} for slime's weight versions" in log, log[-3000:]
    sts = slime.kube.get_json("statefulset", f"{JOB}-trainer", "-n", slime.ns)
    assert sts["spec"]["replicas"] == 1, sts["spec"]
    trainers = slime.pods(f"rlfleet.dev/job={JOB},app.kubernetes.io/component=trainer")
    assert [p["metadata"]["name"] for p in trainers] == [BRIDGE], [p["metadata"]["name"] for p in trainers]
    [container] = trainers[0]["spec"]["containers"]
    command = [*container.get("command", []), *container.get("args", [])]
    assert command[:4] == ["rlfleet", "slime", "bridge", "--config"], command
    assert not any(k.startswith("nvidia.com/") for k in (container.get("resources", {}).get("limits") or {}))
    # no pod of the job trains: none runs the trainer (`rlfleet trainer launch` / `trainer run`)
    for pod in slime.pods():
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            line = " ".join([*c.get("command", []), *c.get("args", [])])
            assert "trainer launch" not in line and "trainer run" not in line, (pod["metadata"]["name"], line)
    deps = json.loads(slime.in_bridge(DEPENDENCIES).strip().splitlines()[-1])
    print(f"the trainer image's slime dependencies: {deps}")
    # the base the bridge published v0 from (builtin:tiny-qwen3 in its model cache) is the host's build:
    # slime's first delta applies to these bytes
    theirs = json.loads(slime.in_bridge(BASE_DIGESTS).strip().splitlines()[-1])
    assert theirs == _base_digests(slime.base), "the bridge's builtin:tiny-qwen3 is not the host's build"

    # every group's engine starts from version 0: its pod Ready, VERSION 0, and its share of the sessions
    def groups_ready() -> dict[str, Any] | None:
        items = slime.kube.get_json("samplergroups", "-n", slime.ns)["items"]
        got = {sg["metadata"]["name"].removeprefix(f"{JOB}-"): sg.get("status", {}) for sg in items}
        if set(got) != set(GROUPS):
            return None
        for group, status in got.items():
            pods = slime.pods(f"rlfleet.dev/samplergroup={JOB}-{group}")
            if not (pods and all(ready(p) for p in pods)) or status.get("appliedWeightVersion") != 0:
                return None
            if float(status.get("sharePercent") or 0) < SHARE_PERCENT_AT_LEAST:
                return None
        return got

    slime.wait(
        f"every group's pod Ready at VERSION 0 with Share% >= {SHARE_PERCENT_AT_LEAST}",
        groups_ready,
        timeout=900,
        interval=2.0,
    )
    print(f"every group Ready at v0 {time.monotonic() - slime.started:.0f}s after apply")
    status = slime.channel_status()
    assert status.get("latestVersion") == 0, status
    assert 0 in slime.versions_seen, slime.versions_seen
    # slime's --rollout-http-endpoint-url (docs/slime.md): the router Service's port
    svc = slime.kube.get_json("service", f"{JOB}-router", "-n", slime.ns)["spec"]
    [port] = [p["port"] for p in svc["ports"] if p.get("name") == "http"]
    documented = re.search(
        r"`http://<job>-router\.<namespace>\.svc:(\d+)`", (REPO / "docs" / "slime.md").read_text()
    )
    assert documented and int(documented.group(1)) == port, (documented and documented.group(0), port)
    print(f"router {slime.router()}; {slime.kube.kubectl('get', 'rlj,sg,wc', '-n', slime.ns).stdout}")


def test_every_version_slime_writes_is_published_and_served_exactly(slime: Slime) -> None:
    """slime's stand-in writes versions 1-6 into the publish volume (deltas xor and overwrite with
    xxh3-128 and adler32 checksums, one full checkpoint), each asked exactly (`exact_version N`) by
    several sessions before the next is written: the bridge publishes each, every group serves it, and
    every answer is that version's."""
    slime.stand_in = SlimeStandIn(slime.publish_dir(), slime.base)
    for kind, encoding, checksum_format in PLAN:
        version = slime.write(kind, encoding, checksum_format)
        started = time.monotonic()
        slime.serve(version)
        print(
            f"v{version} ({kind} {encoding} {checksum_format}) served by every group in {time.monotonic() - started:.1f}s"
        )
    assert slime.published() == list(range(len(PLAN) + 1)), slime.bridge_log()[-3000:]


def test_a_malformed_version_is_refused_and_the_next_full_one_publishes(slime: Slime) -> None:
    """A delta with a flipped byte (written aside, then renamed into the publish dir whole, so that the
    bridge never reads it intact): the bridge refuses it with one log line however often it polls, nothing
    of it is published (the pointer stays, externalVersion is ahead of weightVersion, the refused-versions
    metric says 1); slime's next version, a full checkpoint, publishes, and the delta after it applies."""
    assert slime.stand_in is not None
    good = MALFORMED - 1
    staging = slime.publish_dir().parent / "staging"
    slime.stand_in.publish_dir = staging
    try:
        new = slime.stand_in.perturbed(slime.rng)
        path = slime.stand_in.publish(new, "delta", encoding="overwrite", checksum_format="xxh3-128")
    finally:
        slime.stand_in.publish_dir = slime.publish_dir()
    assert path.name == f"weight_v{MALFORMED:06d}"
    shard = sorted(path.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last tensor's compressed diff
    shard.write_bytes(bytes(raw))
    os.rename(path, slime.publish_dir() / path.name)

    def refused() -> list[str] | None:
        lines = [m.group(0) for m in REFUSED.finditer(slime.bridge_log()) if int(m.group(1)) == MALFORMED]
        return lines or None

    [line] = slime.wait(f"the bridge refusing v{MALFORMED}", refused, timeout=300, interval=2.0)
    print(f"bridge: {line}")
    # the flipped byte decodes to other bytes than slime's: its checksum of the new tensor says so
    assert f"weight_v{MALFORMED:06d}: xxh3-128 checksum mismatch" in line, line
    # the RLJob's status: slime's newest directory ahead of the newest version the channel serves
    status = slime.wait(
        f"the RLJob's externalVersion {MALFORMED}, weightVersion {good}",
        lambda: (
            (s := slime.status()).get("externalVersion") == MALFORMED and s.get("weightVersion") == good and s
        ),
        timeout=300,
        interval=2.0,
    )
    print(
        f"RLJob status: externalVersion {status['externalVersion']}, weightVersion {status['weightVersion']}"
    )
    assert slime.bridge_metric("rlfleet_trainer_slime_refused_versions") == 1.0
    assert slime.bridge_metric("rlfleet_trainer_external_version") == float(MALFORMED)
    # the bridge polled many times meanwhile (every 2 s): still one line, nothing published
    assert refused() == [line], refused()
    assert slime.published() == list(range(MALFORMED)), slime.bridge_log()[-3000:]
    assert slime.latest_version() == good and slime.channel_status().get("latestVersion") == good
    assert not (slime.volume_dir(CLAIM) / f"v{MALFORMED}").exists()
    # slime goes on: a full checkpoint (no history needed), then a delta on it
    for kind, encoding, checksum_format in AFTER_MALFORMED:
        version = slime.write(kind, encoding, checksum_format)
        slime.serve(version)
    assert slime.published() == [*range(MALFORMED), *range(MALFORMED + 1, LAST + 1)], slime.bridge_log()[
        -3000:
    ]
    assert MALFORMED not in slime.versions_seen, slime.versions_seen
    assert len(refused() or []) == 1, refused()
    # once every replica is past it, the refused version is never served: the router says so at once
    headers = {"Authorization": f"Bearer {slime.api_key()}", "X-SMG-Routing-Key": "slime-refused"}
    body = {
        "input_ids": [1, 5, 9, 2],
        "sampling_params": {"max_new_tokens": 4},
        "weight_version": {"exact_version": MALFORMED},
    }
    with httpx.Client(timeout=60, trust_env=False) as client:
        response = client.post(slime.router() + "/generate", json=body, headers=headers)
    assert response.status_code == 409 and response.headers.get("Retry-After"), (
        response.status_code,
        response.text,
    )
    print(f"exact_version {MALFORMED}: {response.status_code} {response.json()['error']['message']}")


def test_the_status_follows_slime_to_its_last_version(slime: Slime) -> None:
    """The WeightChannel's latestVersion, the RLJob's externalVersion and weightVersion, and every
    SamplerGroup's VERSION (and the channel's per-group applied version) reach slime's last version;
    the pointer only moved forwards, through every published version."""
    slime.wait(
        f"the RLJob's externalVersion and weightVersion {LAST}",
        lambda: (s := slime.status()).get("externalVersion") == LAST and s.get("weightVersion") == LAST,
        timeout=300,
        interval=2.0,
    )
    slime.wait(
        f"every SamplerGroup at VERSION {LAST}",
        lambda: slime.group_versions() == dict.fromkeys(GROUPS, LAST),
        timeout=300,
        interval=2.0,
    )
    status = slime.wait(
        f"the WeightChannel at {LAST} with every group applied",
        lambda: (
            (s := slime.channel_status()).get("latestVersion") == LAST
            and {g.get("appliedVersion") for g in s.get("groups") or []} == {LAST}
            and len(s["groups"]) == len(GROUPS)
            and s
        ),
        timeout=300,
        interval=2.0,
    )
    assert sorted(a["view"] for a in status.get("artifacts") or []) == sorted(GROUPS), status
    seen = slime.versions_seen
    assert seen == sorted(set(seen)) and seen[-1] == LAST and MALFORMED not in seen, seen
    assert slime.bridge_metric("rlfleet_trainer_slime_refused_versions") == 0.0
    print(slime.kube.kubectl("get", "rlj,sg,wc", "-n", slime.ns).stdout)  # VERSION: appliedWeightVersion
    # every answer of every version was that version's, from every group
    assert sorted(slime.answered) == [v for v in range(1, LAST + 1) if v != MALFORMED], sorted(slime.answered)
