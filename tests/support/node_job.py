"""An RLJob on the dev cluster's real node as the node tier's fleet tests read it (tests/node/test_node_fleet.py,
test_node_lora.py, test_node_slime.py, test_node_torch.py): its status, pods, logs, the host directory of a
volume claim, the channel's pointer there (and the versions it named, polled), the job's engine key, waits
whose failure carries the test's own diagnosis, and the teardown of the job and its operator."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import yaml

from rlfleet.channel import ChannelError, Manifest
from support.operator_chart import uninstall_operator_chart
from support.waits import wait_for


class NodeJob:
    """Mixed into a test's fleet dataclass, which has `kube` (controlplane.KubeCluster) and `ns`, names the
    job and its weight channel's claim, and says what a failure should show (`diagnosis`)."""

    job: ClassVar[str]  # metadata.name of the RLJob
    claim: ClassVar[str]  # the PersistentVolumeClaim of its weight channel's store
    kube: Any
    ns: str
    versions_seen: list[int]  # the channel's pointer, polled (watching_versions)
    manifests: dict[int, Manifest]  # every version's manifest, read as it lands (read_new_manifests)

    def diagnosis(self) -> str:
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        return self.kube.get_json("rljob", self.job, "-n", self.ns).get("status", {})

    def step(self) -> int:
        return int(self.status().get("step") or 0)

    def pods(self, selector: str | None = None) -> list[dict[str, Any]]:
        extra = ("-l", selector) if selector else ()
        return self.kube.get_json("pods", "-n", self.ns, *extra)["items"]

    def groups(self) -> dict[str, dict[str, Any]]:
        """The job's SamplerGroups by name."""
        items = self.kube.get_json("samplergroups", "-n", self.ns)["items"]
        return {sg["metadata"]["name"]: sg for sg in items}

    def served_versions(self, groups: Iterable[str], at_least: int = 1) -> dict[str, int] | None:
        """`kubectl get sg`'s VERSION (status.appliedWeightVersion) of each group (the name after `<job>-`)
        once every one of `groups`, and no other, shows one >= `at_least`; else None (a wait's check)."""
        versions = {
            name.removeprefix(f"{self.job}-"): sg.get("status", {}).get("appliedWeightVersion")
            for name, sg in self.groups().items()
        }
        ok = set(versions) == set(groups) and all(
            isinstance(v, int) and v >= at_least for v in versions.values()
        )
        return versions if ok else None

    def read_new_manifests(self) -> None:
        """Keep the manifest of every version in the store not read yet (retention deletes old versions:
        the tests compare what they see with versions that may be gone by then)."""
        for directory in self.store_dir().glob("v*"):
            number = directory.name[1:]
            if number.isdigit() and int(number) not in self.manifests:
                try:  # not there yet while the version's files upload
                    raw = (directory / "manifest.json").read_bytes()
                    manifest = Manifest.from_bytes(raw)
                except (OSError, ValueError, ChannelError):
                    continue
                self.keep_manifest(int(number), raw, manifest)

    def keep_manifest(self, version: int, raw: bytes, manifest: Manifest) -> None:
        """What read_new_manifests keeps of a version's manifest (a test may keep more: its bytes' digest)."""
        self.manifests[version] = manifest

    def sampler_pods(self, group: str) -> list[dict[str, Any]]:
        """The group's pods that are not being deleted."""
        return [
            p
            for p in self.pods(f"rlfleet.dev/samplergroup={self.job}-{group}")
            if not p["metadata"].get("deletionTimestamp")
        ]

    def logs(self, pod: str, container: str, *extra: str) -> str:
        return self.kube.kubectl("logs", "-n", self.ns, pod, "-c", container, *extra).stdout

    def log_tail(self, pod: str, container: str | None, lines: int = 30) -> str:
        """The end of a pod's log for a failure's report (never raises: a report must not hide the failure)."""
        try:
            extra = ("-c", container) if container else ()
            return self.kube.kubectl("logs", "-n", self.ns, pod, *extra, f"--tail={lines}").stdout
        except Exception as exc:  # noqa: BLE001
            return f"(no log: {exc})"

    def volume_dir(self, claim: str) -> Path:
        """The directory on the host of the local-path PV bound to `claim` (the node's own disk; read once)."""
        volumes: dict[str, Path] = self.__dict__.setdefault("_volume_dirs", {})
        if claim not in volumes:
            volume = self.kube.get_json("pvc", claim, "-n", self.ns)["spec"]["volumeName"]
            pv = self.kube.get_json("pv", volume)["spec"]
            volumes[claim] = Path((pv.get("hostPath") or pv.get("local"))["path"])
        return volumes[claim]

    def store_dir(self) -> Path:
        """The weight channel's store on the host."""
        return self.volume_dir(self.claim)

    def latest_version(self) -> int | None:
        """The version the channel's pointer names (None: none yet, or being rewritten)."""
        pointer = self.store_dir() / "pointer.json"  # rlfleet.channel.POINTER_KEY
        try:
            return int(json.loads(pointer.read_text())["version"])
        except (OSError, ValueError, KeyError):
            return None

    def api_key(self) -> str:
        """The job's engine key (its Secret `<job>-api-key`, field `key`)."""
        secret = self.kube.get_json("secret", f"{self.job}-api-key", "-n", self.ns)
        return base64.b64decode(secret["data"]["key"]).decode()

    def wait(self, what: str, check: Any, timeout: float, interval: float = 1.0) -> Any:
        """wait_for, with the fleet's diagnosis in the failure."""
        try:
            return wait_for(what, check, timeout=timeout, interval=interval)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnosis()}") from None


def example_rljob(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """An example's documents as users apply them, and its RLJob among them (to change before applying)."""
    docs = list(yaml.safe_load_all(path.read_text()))
    [job] = [d for d in docs if d["kind"] == "RLJob"]
    return docs, job


def ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True."""
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


@contextmanager
def watching_versions(job: NodeJob, on_version: Callable[[], None] | None = None) -> Iterator[None]:
    """Poll the channel's pointer every 0.5 s on a thread while the block runs: each version it names is
    appended to `job.versions_seen` in the order seen (once per change); `on_version` runs after each
    reading that found one (e.g. keep every manifest before retention deletes it). Readings fail while the
    claim is not bound yet: skipped."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.5):
            try:
                version = job.latest_version()
                if version is not None and on_version is not None:
                    on_version()
            except Exception:  # noqa: BLE001 - the PVC is not bound yet
                continue
            if version is not None and (not job.versions_seen or job.versions_seen[-1] != version):
                job.versions_seen.append(version)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join(timeout=5)


def delete_job_and_operator(kube: Any, ns: str) -> None:
    """A fleet test's teardown: the RLJobs first, while the operator runs (it releases the WeightChannel's
    finalizer), then the operator's chart and the namespace. Not checked: the test's own assertions already
    failed or passed."""
    kube.kubectl("delete", "rljob", "--all", "-n", ns, "--wait=true", "--timeout=100s", check=False)
    uninstall_operator_chart(kube, ns)
    kube.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=100s", check=False)
