"""Kueue on the test control plane: the real manager, built from its Go module, with its real webhooks.

    kueue = Kueue(cluster, namespaces=["team-a"], log=print)   # cluster: a controlplane.KubeCluster
    kueue.start()   # CRDs, webhook configurations, the manager as a host process; returns when its webhooks serve
    ...
    kueue.stop()    # webhook configurations gone first, then the process; finalizers it left are removed

The manager (`sigs.k8s.io/kueue/cmd/kueue`, built by controlplane.py from tests/cluster/go/kueue) runs on
this machine against the API server with the admin kubeconfig and a Configuration file: no leader
election, internal cert management off, the webhook server on 127.0.0.1:<free port> with a serving cert
signed by the cluster's CA, the `pod` and `deployment` integrations. Its CRDs and webhook configurations
come from the module's own config/components (the module cache holds the source `go build` used); the
webhooks are rewritten from the in-cluster Service to `url: https://127.0.0.1:<port>/...` and limited to
`namespaces`, so the rest of a shared test session never calls this manager (nor a stopped one).
Only the webhooks of the enabled integrations and of Kueue's own kinds are installed.

Optional: started only by the tests that need it (tests/operator/test_operator_cluster_kueue.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # like devcluster.py: this folder's modules by name

import controlplane as cp  # noqa: E402 - this folder, put on sys.path just above

COMPONENT = "kueue"
MODULE = "sigs.k8s.io/kueue"
NAMESPACE = "kueue-system"  # the manager's own namespace (its Configuration's `namespace`)
ADMISSION_GATE = "kueue.x-k8s.io/admission"  # the scheduling gate on a pod until its Workload is admitted
FRAMEWORKS = ("pod", "deployment")
# webhook paths to install: Kueue's own kinds and the enabled integrations (the others have no handler)
_WEBHOOK_PATHS = ("kueue-x-k8s-io", "-v1-pod", "apps-v1-deployment")
WEBHOOK_CONFIGURATIONS = {
    "MutatingWebhookConfiguration": "rlfleet-test-kueue",
    "ValidatingWebhookConfiguration": "rlfleet-test-kueue",
}
# finalizers Kueue puts on what it manages; a stopped manager removes none of them
_FINALIZED = ("pods", "workloads.kueue.x-k8s.io", "localqueues.kueue.x-k8s.io")
_FINALIZED_CLUSTER = (
    "clusterqueues.kueue.x-k8s.io",
    "resourceflavors.kueue.x-k8s.io",
    "cohorts.kueue.x-k8s.io",
)


# With internal cert management off, cmd/kueue/main.go loads a metrics serving cert from this fixed path at
# start (even with the metrics server off, as here) and exits without one: a placeholder pair is written
# there once per machine (root only; no flag or config field moves it in v0.17.0).
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


class KueueError(RuntimeError):
    pass


class KueueNeedsRoot(KueueError):
    """METRICS_CERT_DIR is missing and this user cannot create it (the tests skip, naming why)."""


def ensure_metrics_cert(pki: Path) -> None:
    """A serving pair at METRICS_CERT_DIR unless one is there (concurrent starts: written aside, then renamed)."""
    if all((METRICS_CERT_DIR / f"tls.{ext}").is_file() for ext in ("crt", "key")):
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".kueue-metrics-", dir=METRICS_CERT_DIR))
    except PermissionError as exc:
        raise KueueNeedsRoot(
            f"Kueue {cp.COMPONENTS[COMPONENT].version()} reads its metrics cert from "
            f"{METRICS_CERT_DIR}, which this user cannot create ({exc}): run as root"
        ) from exc
    cp.write_serving_cert(pki, staging, "tls", ["127.0.0.1"])
    os.replace(staging / "tls.key", METRICS_CERT_DIR / "tls.key")  # the key first: a crt means both are there
    os.replace(staging / "tls.crt", METRICS_CERT_DIR / "tls.crt")
    staging.rmdir()


def module_dir() -> Path:
    """The Kueue module's source in the Go module cache, at the version the wrapper module pins."""
    component = cp.COMPONENTS[COMPONENT]
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "GOFLAGS": f"{os.environ.get('GOFLAGS', '')} -mod=readonly".strip(),
    }
    result = subprocess.run(
        [cp.go_binary(), "list", "-m", "-f", "{{.Dir}}", MODULE],
        cwd=component.wrapper_dir,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    directory = Path(result.stdout.strip())
    if result.returncode != 0 or not (directory / "config" / "components").is_dir():
        raise KueueError(
            f"no source of {MODULE} in the module cache ({result.stderr.strip()}): build it first"
        )
    return directory


def crd_manifests(source: Path) -> list[dict[str, Any]]:
    """Kueue's CRDs as its release ships them, without the conversion-webhook patches (only v1beta2,
    the storage version, is used here: no conversion is needed)."""
    return [
        yaml.safe_load(f.read_text()) for f in sorted((source / "config/components/crd/bases").glob("*.yaml"))
    ]


def webhook_manifests(
    source: Path, port: int, ca_bundle: bytes, namespaces: Sequence[str]
) -> list[dict[str, Any]]:
    """Kueue's webhook configurations (config/components/webhook/manifests.yaml), calling the manager on
    127.0.0.1:`port` and limited to `namespaces`."""
    import base64

    out = []
    for doc in yaml.safe_load_all((source / "config/components/webhook/manifests.yaml").read_text()):
        if not doc:
            continue
        hooks = []
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            if not any(part in path for part in _WEBHOOK_PATHS):
                continue
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca_bundle).decode(),
            }
            hook["namespaceSelector"] = {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(namespaces)}
                ]
            }  # cluster-scoped kinds (ClusterQueue, ResourceFlavor) ignore it: they always match
            hooks.append(hook)
        doc["metadata"] = {"name": WEBHOOK_CONFIGURATIONS[doc["kind"]]}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},  # no metrics server
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


class Kueue:
    """The Kueue manager beside a running control plane (a test's; nothing here is test-only): see the
    module docstring."""

    def __init__(
        self, cluster: Any, namespaces: Sequence[str], log: Callable[[str], None] = lambda msg: None
    ) -> None:
        self.cluster = cluster
        self.namespaces = list(namespaces)
        self.log = log
        self.dir = Path(cluster.workdir) / "kueue"
        self.proc: cp.Proc | None = None

    def start(self, timeout: float = 180.0) -> None:
        bin_dir = cp.build_component(cp.COMPONENTS[COMPONENT], log=self.log)
        source = module_dir()
        pki = Path(self.cluster.workdir) / "pki"
        cert_dir = self.dir / "certs"
        cert_dir.mkdir(parents=True, exist_ok=True)
        cp.write_serving_cert(
            pki, cert_dir, "tls", ["127.0.0.1"]
        )  # controller-runtime reads tls.crt / tls.key
        ensure_metrics_cert(pki)
        webhook_port, health_port = cp.free_port(), cp.free_port()
        config = self.dir / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(webhook_port, health_port, cert_dir), sort_keys=False))
        kubectl = self.cluster.kubectl
        crds = crd_manifests(
            source
        )  # the Workload CRD alone is 1.4 MB: server-side (no last-applied annotation)
        kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump_all(crds))
        self._wait_established([c["metadata"]["name"] for c in crds], timeout)
        kubectl("create", "namespace", NAMESPACE, check=False)  # exists from an earlier start
        log = self.dir / "kueue.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                [
                    str(bin_dir / "kueue"),
                    f"--config={config}",
                    f"--kubeconfig={self.cluster.kubeconfig}",
                    "--feature-gates=VisibilityOnDemand=false",  # its API server extension needs an APIService
                    "--zap-log-level=2",
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=cp.die_with_parent,
                cwd=self.dir,
            )
        self.proc = cp.Proc("kueue", popen, log)
        self._wait_ready(health_port, timeout)
        hooks = webhook_manifests(source, webhook_port, (pki / "ca.crt").read_bytes(), self.namespaces)
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all(hooks))
        self.log(f"kueue {cp.COMPONENTS[COMPONENT].version()} serving webhooks on 127.0.0.1:{webhook_port}")

    def _wait_established(self, crds: list[str], timeout: float) -> None:
        """`kubectl wait` refuses a CRD the API server has not given a status yet: asked again until then."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.cluster.kubectl(
                "wait",
                "--for=condition=Established",
                "--timeout=30s",
                *(f"crd/{name}" for name in crds),
                check=False,
            )
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise KueueError(
                    f"Kueue's CRDs not Established after {timeout:.0f}s: {result.stderr.strip()}"
                )
            time.sleep(0.5)

    def _wait_ready(self, health_port: int, timeout: float) -> None:
        """/readyz turns 200 once the webhook server listens with its certs (cmd/kueue/main.go)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if not self.proc.alive():
                raise KueueError(
                    f"kueue exited ({self.proc.popen.returncode}); log {self.proc.log}:\n{self.proc.tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise KueueError(
                    f"kueue not ready after {timeout:.0f}s; log {self.proc.log}:\n{self.proc.tail()}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        """Webhook configurations first (nothing calls a stopped manager), then the process, then the
        finalizers it left on the objects of `namespaces` and the cluster-scoped Kueue objects."""
        kubectl = self.cluster.kubectl
        for kind, name in WEBHOOK_CONFIGURATIONS.items():
            kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        if self.proc is not None:
            cp._stop_group(
                self.proc.popen.pid, lambda t: cp._wait_popen(self.proc.popen, t) if self.proc else True
            )
            self.proc = None
        unfinalize = json.dumps({"metadata": {"finalizers": None}})
        targets = [(resource, ["-n", ns]) for ns in self.namespaces for resource in _FINALIZED]
        targets += [(resource, []) for resource in _FINALIZED_CLUSTER]
        for resource, where in targets:
            names = kubectl("get", resource, *where, "-o", "name", check=False).stdout.split()
            for name in names:
                kubectl("patch", name, *where, "--type=merge", "-p", unfinalize, check=False)

    def tail(self, lines: int = 40) -> str:
        return self.proc.tail(lines) if self.proc else ""
