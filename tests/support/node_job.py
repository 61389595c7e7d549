"""An RLJob on the dev cluster's real node as the node tier's fleet tests read it (tests/node/test_node_fleet.py,
test_node_lora.py, test_node_slime.py, test_node_torch.py): its status, pods, logs, the host directory of a
volume claim, the channel's pointer there (and the versions it named, polled), the trainer's step history,
the job's engine key and a probe run with it in a sampler pod, waits (the step among them) whose failure
carries a diagnosis (a trainer job's, or the test's own from the same parts), and the teardown of the job
and its operator."""

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
    job, its weight channel's claim and its groups, and may say what a failure should show (`diagnosis`)."""

    job: ClassVar[str]  # metadata.name of the RLJob
    claim: ClassVar[str]  # the PersistentVolumeClaim of its weight channel's store
    group_names: ClassVar[tuple[str, ...]] = ()  # its sampler groups (the names after `<job>-`)
    kube: Any
    ns: str
    versions_seen: list[int]  # the channel's pointer, polled (watching_versions)
    manifests: dict[int, Manifest]  # every version's manifest, read as it lands (read_new_manifests)

    def diagnosis(self) -> str:
        """A failure's report for a job with trainer pods: what the RLJob, the groups' sidecars, the
        trainer and the operator say (a job with other pods says its own, from the same parts)."""
        parts = self.report_head()
        parts.append(f"trainer log tail:\n{self.log_tail(f'{self.job}-trainer-0', 'trainer', lines=40)}")
        parts += self.sampler_log_tails()
        for op in self.pods("app.kubernetes.io/name=rlfleet"):
            parts.append(f"operator log tail:\n{self.log_tail(op['metadata']['name'], None)}")
        return "\n".join(parts)

    def report_head(self) -> list[str]:
        """A report's first parts: the RLJob's status and `kubectl get rlj,sg,wc,pods -o wide`."""
        parts = [f"RLJob status: {self.status()}"]
        try:
            parts.append(self.kube.kubectl("get", "rlj,sg,wc,pods", "-n", self.ns, "-o", "wide").stdout)
        except Exception as exc:  # noqa: BLE001 - a report must not hide the failure it reports
            parts.append(f"(no table: {exc})")
        return parts

    def sampler_log_tails(self) -> list[str]:
        """The weight-sync sidecar's log tail of every pod of the job's groups."""
        return [
            f"{name} weight-sync log tail:\n{self.log_tail(name, 'weight-sync')}"
            for group in self.group_names
            for name in (
                p["metadata"]["name"] for p in self.pods(f"rlfleet.dev/samplergroup={self.job}-{group}")
            )
        ]

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

    def history(self) -> list[dict[str, float]]:
        """The trainer's per-step metrics, from its newest checkpoint in the store."""
        from rlfleet.trainer.publish import checkpoint

        latest = checkpoint.load_latest(self.store_dir() / "checkpoints")
        return list(latest["history"]) if latest else []

    def probe(self, pod: str, script: str) -> dict[str, Any]:
        """Run `script` (python3 -I) in a sampler pod's weight-sync container, the job's key on its stdin
        (never on a command line), and return the JSON of the last line it prints."""
        out = self.kube.kubectl(
            "exec",
            "-i",
            "-n",
            self.ns,
            pod,
            "-c",
            "weight-sync",
            "--",
            "python3",
            "-I",
            "-c",
            script,
            input=self.api_key(),
        ).stdout
        return json.loads(out.strip().splitlines()[-1])

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

    def wait_step(self, at_least: int, timeout: float = 900) -> int:
        """The RLJob's step once it is `at_least`."""
        return self.wait(f"RLJob step >= {at_least}", lambda: (s := self.step()) >= at_least and s, timeout)


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
