"""A real Kubernetes control plane for the tests, built from Go modules (no Docker, no kind).

Library + CLI:

    .venv/bin/python tests/cluster/controlplane.py build [NAME ...]   # cached per version; instant when warm
    .venv/bin/python tests/cluster/controlplane.py up                  # prints a KUBECONFIG path
    .venv/bin/python tests/cluster/controlplane.py status
    .venv/bin/python tests/cluster/controlplane.py down                # no process, no port left

Components (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok) are built from the
pinned wrapper modules under tests/cluster/go/<name>/ into ~/.cache/rlfleet/kube-bin/<name>-<version>/ and
started on free 127.0.0.1 ports in a scratch directory. Each runs in its own process group and gets
SIGKILL if the process that started it dies (PR_SET_PDEATHSIG), so nothing outlives a test session.
kwok fakes the nodes: two per GPU class (GPU Feature Discovery labels, `nvidia.com/gpu: 8`, taint
`nvidia.com/gpu=present:NoSchedule`) plus two CPU nodes; it keeps their Leases fresh and moves pods
bound to them to Running/Ready.

The pytest fixtures `kube` and `namespace` (tests/conftest.py) wrap `ControlPlane` and `KubeCluster`.

`ControlPlane(..., real_node=True)` adds the dev cluster's real node (realnode.py; `scripts/dev-cluster`,
docs/dev-cluster.md): kwok then fakes only the GPU nodes, and the API server listens on the node's bridge.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CLUSTER_DIR = Path(__file__).resolve().parent
if str(CLUSTER_DIR.parent) not in sys.path:  # run as a script (`controlplane.py up`): tests/, for support/
    sys.path.append(str(CLUSTER_DIR.parent))
from support.ports import free_port  # noqa: E402 - tests/, put on sys.path just above
from support.processes import die_with_parent  # noqa: E402

GO_DIR = CLUSTER_DIR / "go"
# Binaries live in the user's cache, keyed by component, version and a hash of the wrapper module,
# so a fresh clone on a machine that built them before starts warm (never required: cold builds).
_USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
BIN_ROOT = Path(os.environ.get("RLFLEET_KUBE_BIN_ROOT") or _USER_CACHE / "rlfleet" / "kube-bin")
WORK_ROOT = CLUSTER_DIR / ".work"
KWOK_STAGES = CLUSTER_DIR / "kwok-stages.yaml"
SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.1/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTROL_PLANE_COMPONENTS = ("kubernetes", "etcd", "kwok")  # what ControlPlane.start() needs
NODE_COMPONENTS = (
    "node",
    "coredns",
    "local-path-provisioner",
    "kube-router",
)  # and with the real node (realnode.py)


# --------------------------------------------------------------------------------------------------
# Builder: one table entry per Go wrapper module.
# --------------------------------------------------------------------------------------------------


def _k8s_version_ldflags(version: str) -> list[str]:
    """`kubectl version` / `/version` report the real release instead of v0.0.0-master."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return flags


@dataclass(frozen=True)
class GoComponent:
    """How to build one wrapper module: `go build -o bin/<name>-<version>/ <packages>`.

    `module`'s version is read from the wrapper's go.mod (the single source of truth) and names the
    cache directory; `binaries` maps the output file name to its main package.
    """

    name: str
    module: str
    binaries: dict[str, str]
    ldflags: Callable[[str], list[str]] = lambda version: []
    default: bool = True  # built by `controlplane.py build` without names (scripts/test runs that)
    wrapper: str | None = None  # the wrapper module's folder under go/ when it is not `name`

    @property
    def wrapper_dir(self) -> Path:
        return GO_DIR / (self.wrapper or self.name)

    def version(self) -> str:
        text = (self.wrapper_dir / "go.mod").read_text()
        match = re.search(rf"^\s*(?:require\s+)?{re.escape(self.module)}\s+(v\S+)", text, re.MULTILINE)
        if not match:
            raise BuildError(f"{self.wrapper_dir}/go.mod does not require {self.module}")
        return match.group(1)

    def bin_dir(self) -> Path:
        return BIN_ROOT / f"{self.name}-{self.version()}"

    def stamp(self) -> str:
        """Hash of everything that decides the binaries: go.mod, go.sum, the wrapper's own Go files
        (coredns's main.go), packages, flags."""
        digest = hashlib.sha256()
        for file in ("go.mod", "go.sum", *sorted(p.name for p in self.wrapper_dir.glob("*.go"))):
            digest.update((self.wrapper_dir / file).read_bytes())
        digest.update(json.dumps([self.binaries, self.ldflags(self.version())], sort_keys=True).encode())
        return digest.hexdigest()

    def up_to_date(self) -> bool:
        out = self.bin_dir()
        stamp_file = out / ".stamp"
        return (
            stamp_file.is_file()
            and stamp_file.read_text().strip() == self.stamp()
            and all(os.access(out / b, os.X_OK) for b in self.binaries)
        )


COMPONENTS: dict[str, GoComponent] = {
    c.name: c
    for c in (
        GoComponent(
            name="kubernetes",
            module="k8s.io/kubernetes",
            binaries={
                b: f"k8s.io/kubernetes/cmd/{b}"
                for b in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
            },
            ldflags=_k8s_version_ldflags,
        ),
        GoComponent(
            name="node",
            module="k8s.io/kubernetes",
            binaries={b: f"k8s.io/kubernetes/cmd/{b}" for b in ("kubelet", "kube-proxy")},
            ldflags=_k8s_version_ldflags,
            wrapper="kubernetes",
        ),  # the real node of the dev cluster (tests/cluster/realnode.py): same module, same release
        GoComponent(
            name="coredns",
            module="github.com/coredns/coredns",
            binaries={"coredns": "rlfleet.dev/tests/cluster/coredns"},  # main.go: the plugins we use
            ldflags=lambda v: [f"-X github.com/coredns/coredns/coremain.GitCommit={v}"],
        ),  # the dev cluster's DNS (tests/cluster/realnode.py)
        GoComponent(
            name="kube-router",
            module="github.com/cloudnativelabs/kube-router/v2",
            binaries={"kube-router": "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"},
            ldflags=lambda v: [f"-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version={v}"],
        ),  # the dev cluster's NetworkPolicy enforcement, its firewall controller only (tests/cluster/realnode.py)
        GoComponent(
            name="local-path-provisioner",
            module="github.com/rancher/local-path-provisioner",
            binaries={"local-path-provisioner": "github.com/rancher/local-path-provisioner"},
        ),  # the dev cluster's storage class for PVCs (tests/cluster/realnode.py)
        GoComponent(
            name="etcd", module="go.etcd.io/etcd/server/v3", binaries={"etcd": "go.etcd.io/etcd/server/v3"}
        ),
        GoComponent(
            name="kwok",
            module="sigs.k8s.io/kwok",
            binaries={"kwok": "sigs.k8s.io/kwok/cmd/kwok"},
            ldflags=lambda v: [f"-X sigs.k8s.io/kwok/pkg/consts.Version={v}"],
        ),
        GoComponent(
            name="helm",
            module="helm.sh/helm/v4",
            binaries={"helm": "helm.sh/helm/v4/cmd/helm"},
            ldflags=lambda v: [f"-X helm.sh/helm/v4/internal/version.version={v}"],
        ),  # for the chart tests (tests/ship); the control plane itself does not need it
        GoComponent(
            name="promtool",
            module="github.com/prometheus/prometheus",
            binaries={"promtool": "github.com/prometheus/prometheus/cmd/promtool"},
        ),  # runs the chart's PrometheusRule alerts on synthetic series (tests/ship)
        GoComponent(
            name="actionlint",
            module="github.com/rhysd/actionlint",
            binaries={"actionlint": "github.com/rhysd/actionlint/cmd/actionlint"},
            ldflags=lambda v: [f"-X github.com/rhysd/actionlint.version={v}"],
        ),  # lints the release workflow, .github/workflows/release.yml (tests/ship/test_ship_release.py)
        GoComponent(
            name="kueue",
            module="sigs.k8s.io/kueue",
            binaries={"kueue": "sigs.k8s.io/kueue/cmd/kueue"},
            ldflags=lambda v: [f"-X sigs.k8s.io/kueue/pkg/version.GitVersion={v}"],
        ),  # quota admission of the trainer gang and sampler groups (tests/cluster/kueue.py)
    )
}


class BuildError(RuntimeError):
    pass


def go_binary() -> str:
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise BuildError("no Go toolchain found: install Go >= 1.26 or set GO=/path/to/go")


def _default_binary_name(package: str) -> str:
    """The file `go build -o DIR/` writes for a main package (major-version suffixes are skipped)."""
    parts = package.split("/")
    return parts[-2] if re.fullmatch(r"v\d+", parts[-1]) else parts[-1]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Several engineers run tests at once: only one of them builds a component."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_component(component: GoComponent, log: Callable[[str], None] = print) -> Path:
    """Build one component unless its cache directory already holds binaries with the same stamp."""
    if component.up_to_date():
        return component.bin_dir()
    out = component.bin_dir()
    with _file_lock(BIN_ROOT / f".{component.name}.lock"):
        if component.up_to_date():  # another process built it while we waited
            return out
        version = component.version()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=BIN_ROOT))
        ldflags = " ".join(["-s", "-w", *component.ldflags(version)])
        cmd = [
            go_binary(),
            "build",
            "-trimpath",
            "-ldflags",
            ldflags,
            "-o",
            f"{tmp}/",
            *component.binaries.values(),
        ]
        goflags = f"{os.environ.get('GOFLAGS', '')} -mod=readonly".strip()  # go.sum pins every module
        env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": goflags}
        log(f"building {component.name} {version} (cold builds take minutes) ...")
        started = time.monotonic()
        result = subprocess.run(cmd, cwd=component.wrapper_dir, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BuildError(f"go build for {component.name} failed:\n{result.stderr[-4000:]}")
        for name, package in component.binaries.items():
            built = tmp / _default_binary_name(package)
            if built.name != name:
                built.rename(tmp / name)
        (tmp / ".stamp").write_text(component.stamp() + "\n")
        tmp.chmod(0o755)  # mkdtemp made it private; the cache is shared by everyone on the machine
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        log(f"built {component.name} {version} in {time.monotonic() - started:.0f}s -> {out}")
    return out


def build(names: Sequence[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Build the named components (default: every `default` one); returns name -> bin dir."""
    selected = list(names) if names else [n for n, c in COMPONENTS.items() if c.default]
    unknown = [n for n in selected if n not in COMPONENTS]
    if unknown:
        raise BuildError(f"unknown component(s) {unknown}; known: {sorted(COMPONENTS)}")
    return {name: build_component(COMPONENTS[name], log) for name in selected}


# --------------------------------------------------------------------------------------------------
# Fake nodes: pure data.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuClass:
    product: str  # nvidia.com/gpu.product (GFD: NVML name with spaces as dashes)
    family: str
    compute: tuple[int, int]
    memory_mib: int
    gke: str  # cloud.google.com/gke-accelerator


GPU_CLASSES: dict[str, GpuClass] = {
    "a100": GpuClass("NVIDIA-A100-SXM4-80GB", "ampere", (8, 0), 81920, "nvidia-a100-80gb"),
    "h100": GpuClass("NVIDIA-H100-80GB-HBM3", "hopper", (9, 0), 81559, "nvidia-h100-80gb"),
    "h200": GpuClass("NVIDIA-H200", "hopper", (9, 0), 143771, "nvidia-h200-141gb"),
    "b200": GpuClass("NVIDIA-B200", "blackwell", (10, 0), 183359, "nvidia-b200"),
    "b300": GpuClass("NVIDIA-B300-SXM6-AC", "blackwell", (10, 3), 275040, "nvidia-b300"),
    "rtx-pro-6000": GpuClass(
        "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "blackwell", (12, 0), 97887, "nvidia-rtx-pro-6000"
    ),
}
GPUS_PER_NODE = 8
NODES_PER_CLASS = 2
CPU_NODES = ["cpu-0", "cpu-1"]
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def _node(name: str, labels: dict[str, str], resources: dict[str, str], taints: list[dict]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **labels,
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": taints},
        "status": {"allocatable": resources, "capacity": resources},
    }


def gpu_node_names() -> dict[str, list[str]]:
    return {cls: [f"gpu-{cls}-{i}" for i in range(NODES_PER_CLASS)] for cls in GPU_CLASSES}


def node_manifests(cpu_nodes: bool = True) -> list[dict[str, Any]]:
    """Two nodes per GPU class (GFD labels; GKE's accelerator label on the second one) + CPU nodes
    (not beside a real node: CPU pods must land where they really run)."""
    nodes = []
    for cls, gpu in GPU_CLASSES.items():
        for i, name in enumerate(gpu_node_names()[cls]):
            labels = {
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": gpu.product,
                "nvidia.com/gpu.family": gpu.family,
                "nvidia.com/gpu.compute.major": str(gpu.compute[0]),
                "nvidia.com/gpu.compute.minor": str(gpu.compute[1]),
                "nvidia.com/gpu.memory": str(gpu.memory_mib),
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
            }
            if i == 1:
                labels["cloud.google.com/gke-accelerator"] = gpu.gke
            resources = {"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(GPUS_PER_NODE)}
            nodes.append(_node(name, labels, resources, [dict(GPU_TAINT)]))
    for name in CPU_NODES if cpu_nodes else []:
        nodes.append(_node(name, {}, {"cpu": "32", "memory": "128Gi", "pods": "110"}, []))
    return nodes


# --------------------------------------------------------------------------------------------------
# Certificates and kubeconfigs (generated in Python; ECDSA P-256 is quick to make).
# --------------------------------------------------------------------------------------------------


def _key_pem(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _x509_name(cn: str, org: str | None = None) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _sign_leaf(
    out: Path, file: str, subject: Any, ca_cert: Any, ca_key: Any, server_names: Sequence[str] | None
) -> None:
    """`out/<file>.crt` + `.key`, signed by the CA: a serving cert for `server_names` (DNS names and IPs),
    or a client cert when None."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [
                    ExtendedKeyUsageOID.SERVER_AUTH
                    if server_names is not None
                    else ExtendedKeyUsageOID.CLIENT_AUTH
                ]
            ),
            critical=False,
        )
    )
    if server_names is not None:
        sans: list[x509.GeneralName] = []
        for entry in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(entry)))
            except ValueError:
                sans.append(x509.DNSName(entry))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    (out / f"{file}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (out / f"{file}.key").write_bytes(_key_pem(key))


def write_serving_cert(pki: Path, out: Path, file: str, server_names: Sequence[str]) -> None:
    """`out/<file>.crt` + `.key`: a serving cert signed by the control plane's CA (`pki` of a running one),
    e.g. for a webhook server on 127.0.0.1 that the API server calls with the CA as caBundle
    (tests/cluster/kueue.py)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    _sign_leaf(out, file, _x509_name(file), ca_cert, ca_key, server_names)


def _write_pki(
    pki: Path, server_ips: Sequence[str] = (), extra_leaves: dict[str, tuple[str, str | None]] | None = None
) -> None:
    """The CA, the API server's serving cert (also valid for `server_ips`) and the client certs
    (`extra_leaves`: file -> (CN, O), e.g. the real node's kubelet)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pki.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    name = _x509_name

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("rlfleet-test-ca"))
        .issuer_name(name("rlfleet-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        # key identifiers: Python >= 3.13 verifies strictly (VERIFY_X509_STRICT) and refuses a chain
        # without them ("Missing Authority Key Identifier"), e.g. the operator in a dev-cluster pod
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (pki / "ca.crt").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (pki / "ca.key").write_bytes(_key_pem(ca_key))

    def leaf(file: str, subject: x509.Name, server: bool) -> None:
        server_names = [
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
            "127.0.0.1",
            str(next(ipaddress.ip_network(SERVICE_CIDR).hosts())),
            *server_ips,
        ]
        _sign_leaf(pki, file, subject, ca_cert, ca_key, server_names if server else None)

    leaf("apiserver", name("kube-apiserver"), server=True)
    leaf("admin", name("admin", "system:masters"), server=False)
    leaf("kube-controller-manager", name("system:kube-controller-manager"), server=False)
    leaf("kube-scheduler", name("system:kube-scheduler"), server=False)
    leaf("kwok", name("kwok-controller", "system:masters"), server=False)
    for file, (cn, org) in (extra_leaves or {}).items():
        leaf(file, name(cn, org), server=False)

    sa_key = ec.generate_private_key(ec.SECP256R1())  # signs ServiceAccount tokens (ES256)
    (pki / "sa.key").write_bytes(_key_pem(sa_key))
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _write_kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    def b64(file: str) -> str:
        return base64.b64encode((pki / file).read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "rlfleet-test",
                "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(f"{user}.crt"),
                    "client-key-data": b64(f"{user}.key"),
                },
            }
        ],
        "contexts": [{"name": "rlfleet-test", "context": {"cluster": "rlfleet-test", "user": user}}],
        "current-context": "rlfleet-test",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)


# --------------------------------------------------------------------------------------------------
# Processes.
# --------------------------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _stop_group(pid: int, wait: Callable[[float], bool], grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it is still there after `grace` seconds."""
    for sig, timeout in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        if wait(timeout):
            # the leader is gone; make sure no child of it is left in the group either
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


class ControlPlaneError(RuntimeError):
    pass


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


# --------------------------------------------------------------------------------------------------
# The handle tests use.
# --------------------------------------------------------------------------------------------------


@dataclass
class KubeCluster:
    """A running control plane: what the `kube` fixture returns."""

    kubeconfig: Path
    kubectl_bin: Path
    bin_dir: Path
    server: str
    workdir: Path
    gpu_nodes: dict[str, list[str]] = field(default_factory=gpu_node_names)
    cpu_nodes: list[str] = field(default_factory=lambda: list(CPU_NODES))
    start_seconds: float = 0.0

    def env(self) -> dict[str, str]:
        """os.environ + KUBECONFIG (+ our bin dir first on PATH, and a private kubectl cache)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "KUBECACHEDIR": str(self.workdir / "kubecache"),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        cmd = [str(self.kubectl_bin), *args]
        result = subprocess.run(cmd, env=self.env(), input=input, text=True, capture_output=True, timeout=120)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def apply(
        self, *objects: Any, namespace: str | None = None, create: bool = False, check: bool = True
    ) -> subprocess.CompletedProcess:
        """`kubectl apply [-n namespace] -f -` of these objects as JSON (several as one v1 List); `create`:
        `kubectl create` instead (an existing object is an error; no last-applied annotation is written)."""
        document = (
            objects[0] if len(objects) == 1 else {"apiVersion": "v1", "kind": "List", "items": list(objects)}
        )
        scope = ["-n", namespace] if namespace else []
        verb = "create" if create else "apply"
        return self.kubectl(verb, *scope, "-f", "-", input=json.dumps(document), check=check)

    def api_client(self):  # -> kubernetes.client.ApiClient
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    @property
    def ca_file(self) -> Path:
        """The cluster CA (PEM), e.g. for a client that authenticates with a ServiceAccount token."""
        return self.workdir / "pki" / "ca.crt"

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """Write a kubeconfig that authenticates with `token` (e.g. from `kubectl create token`)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rlfleet-test",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": base64.b64encode(self.ca_file.read_bytes()).decode(),
                    },
                }
            ],
            "users": [{"name": "token", "user": {"token": token}}],
            "contexts": [{"name": "rlfleet-test", "context": {"cluster": "rlfleet-test", "user": "token"}}],
            "current-context": "rlfleet-test",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    @classmethod
    def from_state(cls, workdir: Path) -> KubeCluster:
        """Attach to a control plane started by `controlplane.py up` (see state.json)."""
        state = json.loads((workdir / "state.json").read_text())
        return cls(
            kubeconfig=Path(state["kubeconfig"]),
            kubectl_bin=Path(state["kubectl"]),
            bin_dir=Path(state["bin_dir"]),
            server=state["server"],
            workdir=workdir,
            start_seconds=state.get("start_seconds", 0.0),
        )


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok in `workdir`; with
    `real_node`, also the dev cluster's real node (realnode.py: containerd, kubelet, kube-proxy, CoreDNS,
    local-path storage), and the API server listens on the node's bridge so pods reach it."""

    def __init__(
        self, workdir: Path, log: Callable[[str], None] = lambda msg: None, real_node: bool = False
    ) -> None:
        self.workdir = Path(workdir)
        self.log = log
        self.procs: list[Proc] = []
        self.cluster: KubeCluster | None = None
        self._ssl: ssl.SSLContext | None = None
        self.node: Any = None  # realnode.RealNode when real_node
        if real_node:
            sys.path.insert(0, str(CLUSTER_DIR))  # realnode.py and nodeimages.py import each other by name
            import realnode

            self.node = realnode.RealNode(self.workdir, log)

    # ---- helpers ----
    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() signals the whole group
                preexec_fn=die_with_parent,
                cwd=self.workdir,
                env=env or os.environ.copy(),
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        self._write_pids()
        return proc

    def _write_pids(self) -> None:
        pids = {p.name: p.popen.pid for p in self.procs}
        (self.workdir / "pids.json").write_text(json.dumps(pids))

    def _wait(self, what: str, check: Callable[[], bool], timeout: float, procs: Sequence[Proc] = ()) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for proc in procs or self.procs:
                if not proc.alive():
                    raise ControlPlaneError(
                        f"{proc.name} exited ({proc.popen.returncode}) while waiting for {what}; "
                        f"log {proc.log}:\n{proc.tail()}"
                    )
            try:
                if check():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name}:\n{p.tail(10)}" for p in self.procs)
                raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
            time.sleep(0.2)

    def _https_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            pki = self.workdir / "pki"
            self._ssl = ssl.create_default_context(cafile=str(pki / "ca.crt"))
            self._ssl.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        return self._ssl

    def api_get(self, path: str) -> Any:
        assert self.cluster is not None
        with urllib.request.urlopen(
            self.cluster.server + path, context=self._https_context(), timeout=5
        ) as r:
            body = r.read()
        return json.loads(body) if body[:1] in (b"{", b"[") else body.decode()

    # ---- lifecycle ----
    def start(self) -> KubeCluster:
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        bins = build(CONTROL_PLANE_COMPONENTS + (NODE_COMPONENTS if self.node else ()), log=self.log)
        # extras already built (helm) are linked too, never built here
        bins |= {n: c.bin_dir() for n, c in COMPONENTS.items() if n not in bins and c.up_to_date()}
        bin_dir = self.workdir / "bin"  # one PATH entry with every binary of this control plane
        bin_dir.mkdir(exist_ok=True)
        for name, directory in bins.items():
            for binary in COMPONENTS[name].binaries:
                link = bin_dir / binary
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(directory / binary)

        pki = self.workdir / "pki"
        if self.node:
            self.node.prepare_host()  # the bridge the API server listens on
            _write_pki(pki, [self.node.ip], self.node.client_certs())
        else:
            _write_pki(pki)
        try:
            self._start_etcd_and_apiserver(bin_dir, pki)
            assert self.cluster is not None
            server = self.cluster.server
            for user in ("kube-controller-manager", "kube-scheduler", "kwok"):
                _write_kubeconfig(self.workdir / f"{user}.kubeconfig", server, pki, user)
            self._spawn(
                "kube-controller-manager",
                [
                    str(bin_dir / "kube-controller-manager"),
                    f"--kubeconfig={self.workdir}/kube-controller-manager.kubeconfig",
                    "--secure-port=0",
                    "--leader-elect=false",
                    "--use-service-account-credentials=true",
                    f"--service-account-private-key-file={pki}/sa.key",
                    f"--root-ca-file={pki}/ca.crt",
                    f"--cluster-signing-cert-file={pki}/ca.crt",
                    f"--cluster-signing-key-file={pki}/ca.key",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--controllers=*",
                    "--v=1",
                ],
            )
            self._spawn(
                "kube-scheduler",
                [
                    str(bin_dir / "kube-scheduler"),
                    f"--kubeconfig={self.workdir}/kube-scheduler.kubeconfig",
                    "--secure-port=0",  # no health/metrics server: one port less, nothing to secure
                    "--leader-elect=false",
                    "--v=1",
                ],
            )
            # kwok reads ~/.kwok/kwok.yaml if present: give it an empty HOME so only our stages count.
            kwok_home = self.workdir / "kwok-home"
            kwok_home.mkdir(exist_ok=True)
            self._spawn(
                "kwok",
                [
                    str(bin_dir / "kwok"),
                    f"--kubeconfig={self.workdir}/kwok.kubeconfig",
                    f"--config={KWOK_STAGES}",
                    # kwok fakes only its own nodes: a real node's pods are the kubelet's
                    "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                    "--node-lease-duration-seconds=40",
                    f"--cidr={POD_CIDR}",
                    "--node-ip=10.96.0.1",
                ],
                env={**os.environ, "HOME": str(kwok_home)},
            )
            self.cluster.kubectl(
                "apply", "-f", "-", input=yaml.safe_dump_all(node_manifests(cpu_nodes=not self.node))
            )
            self._wait("nodes Ready and untainted", self._nodes_ready, timeout=120)
            self._wait("default ServiceAccount and kube-root-ca.crt", self._namespace_ready, timeout=60)
            if self.node:
                for user in self.node.client_certs():
                    _write_kubeconfig(self.node.dir / f"{user}.kubeconfig", server, pki, user)
                self.node.start(
                    self._spawn, self._wait, bin_dir, pki, self.cluster.kubectl, free_port, SERVICE_CIDR
                )
                self.cluster.cpu_nodes = [self.node.name]
        except BaseException:
            self.stop()
            raise
        self.cluster.start_seconds = time.monotonic() - started
        return self.cluster

    def _start_etcd_and_apiserver(self, bin_dir: Path, pki: Path, attempts: int = 3) -> None:
        """Free ports are picked before binding, so a race with another process is possible: retry."""
        for attempt in range(1, attempts + 1):
            client, peer, secure = free_port(), free_port(), free_port()
            etcd = self._spawn(
                "etcd",
                [
                    str(bin_dir / "etcd"),
                    "--name=default",
                    f"--data-dir={self.workdir}/etcd",
                    f"--listen-client-urls=http://127.0.0.1:{client}",
                    f"--advertise-client-urls=http://127.0.0.1:{client}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer}",
                    "--unsafe-no-fsync=true",
                    "--log-level=warn",
                ],
            )
            address = self.node.ip if self.node else "127.0.0.1"
            server = f"https://{address}:{secure}"
            kubeconfig = self.workdir / "kubeconfig"
            _write_kubeconfig(kubeconfig, server, pki, "admin")
            self.cluster = KubeCluster(
                kubeconfig=kubeconfig,
                kubectl_bin=bin_dir / "kubectl",
                bin_dir=bin_dir,
                server=server,
                workdir=self.workdir,
            )
            apiserver = self._spawn(
                "kube-apiserver",
                [
                    str(bin_dir / "kube-apiserver"),
                    f"--etcd-servers=http://127.0.0.1:{client}",
                    f"--cert-dir={pki}",
                    f"--tls-cert-file={pki}/apiserver.crt",
                    f"--tls-private-key-file={pki}/apiserver.key",
                    f"--secure-port={secure}",
                    f"--bind-address={address}",
                    f"--advertise-address={address}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--allow-privileged=true",
                    f"--client-ca-file={pki}/ca.crt",
                    f"--service-account-issuer={SA_ISSUER}",
                    f"--service-account-key-file={pki}/sa.pub",
                    f"--service-account-signing-key-file={pki}/sa.key",
                    *(
                        [  # the `kubernetes` Service points at the API server; kubelets are authorized as nodes
                            "--authorization-mode=Node,RBAC",
                            f"--kubelet-client-certificate={pki}/apiserver-kubelet-client.crt",
                            f"--kubelet-client-key={pki}/apiserver-kubelet-client.key",
                            "--kubelet-preferred-address-types=InternalIP",  # no DNS name for the node
                        ]
                        if self.node
                        else ["--authorization-mode=RBAC", "--endpoint-reconciler-type=none"]
                    ),
                    "--v=1",
                ],
            )
            try:
                self._wait(
                    "kube-apiserver /readyz", lambda: self.api_get("/readyz") == "ok", 90, [etcd, apiserver]
                )
                return
            except ControlPlaneError as err:
                in_use = "address already in use" in (etcd.tail(50) + apiserver.tail(50))
                self._stop_processes()
                if not in_use or attempt == attempts:
                    raise err
                shutil.rmtree(self.workdir / "etcd", ignore_errors=True)

    def _nodes_ready(self) -> bool:
        nodes = self.api_get("/api/v1/nodes")["items"]
        if len(nodes) < len(node_manifests(cpu_nodes=not self.node)):
            return False
        for node in nodes:
            ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
            if not ready or ready[0]["status"] != "True":
                return False
            # the node lifecycle controller removes the not-ready taint TaintNodesByCondition added
            if any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints", [])):
                return False
        return True

    def _namespace_ready(self) -> bool:
        self.api_get("/api/v1/namespaces/default/serviceaccounts/default")
        self.api_get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
        return True

    def stop(self) -> None:
        if self.node and self.cluster and self.procs:
            try:
                self.node.drain()  # while the API server is up: the kubelet tears its pods down properly
            except Exception as err:  # noqa: BLE001 - the sweep below takes back what is left
                self.log(f"node drain failed: {err}")
        try:
            self._stop_processes()
        finally:
            if self.node:
                self.node.sweep()

    def _stop_processes(self) -> None:
        try:
            for proc in reversed(self.procs):
                _stop_group(proc.popen.pid, lambda t, p=proc: _wait_popen(p.popen, t))
        except BaseException:  # e.g. a second Ctrl-C: no more grace, kill every group now
            for proc in self.procs:
                try:
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise
        finally:
            self.procs.clear()
            self._write_pids_if_possible()

    def _write_pids_if_possible(self) -> None:
        try:
            (self.workdir / "pids.json").write_text("{}")
        except FileNotFoundError:  # the work dir is gone (`down`): a cleanup never raises on what is missing
            pass


def scratch_dir(prefix: str = "rlfleet-kube-") -> Path:
    """A temp dir owned by this process; removes dirs left by owners that were killed (SIGKILL)."""
    for stale in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            owner = int((stale / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            shutil.rmtree(stale, ignore_errors=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    (workdir / "owner.pid").write_text(str(os.getpid()))
    return workdir


def _wait_popen(popen: subprocess.Popen, timeout: float) -> bool:
    try:
        popen.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def _wait_pid(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --------------------------------------------------------------------------------------------------
# CLI: build / up / down / status. `up` starts a detached supervisor that owns the processes.
# --------------------------------------------------------------------------------------------------


def _supervise(workdir: Path, real_node: bool = False) -> int:
    """Run the control plane until SIGTERM/SIGINT (the `up` background process)."""
    plane = ControlPlane(workdir, log=lambda msg: print(msg, flush=True), real_node=real_node)

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster = plane.start()
        state = {
            "pid": os.getpid(),
            "kubeconfig": str(cluster.kubeconfig),
            "kubectl": str(cluster.kubectl_bin),
            "bin_dir": str(cluster.bin_dir),
            "server": cluster.server,
            "start_seconds": round(cluster.start_seconds, 2),
        }
        (workdir / "state.json").write_text(json.dumps(state, indent=2))
        print(f"ready in {cluster.start_seconds:.1f}s: KUBECONFIG={cluster.kubeconfig}", flush=True)
        while all(p.alive() for p in plane.procs):
            time.sleep(1)
        dead = [p.name for p in plane.procs if not p.alive()]
        print(f"component(s) exited: {dead}; stopping", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    except Exception as err:  # noqa: BLE001 - report to `up` through the log and the error file
        try:
            (workdir / "error.txt").write_text(str(err))
        except FileNotFoundError:  # the work dir is gone (`down`): the log below still says it
            pass
        print(f"error: {err}", flush=True)
        return 1
    finally:
        plane.stop()
        (workdir / "state.json").unlink(missing_ok=True)


def _running_pid(workdir: Path) -> int | None:
    try:
        pid = int(json.loads((workdir / "supervisor.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None
    return pid if _pid_alive(pid) else None


def cmd_up(workdir: Path, foreground: bool, real_node: bool = False, timeout: float = 300) -> int:
    if _running_pid(workdir):
        print(f"already running; KUBECONFIG={workdir / 'kubeconfig'}", file=sys.stderr)
        print(workdir / "kubeconfig")
        return 0
    build(
        CONTROL_PLANE_COMPONENTS + (NODE_COMPONENTS if real_node else ()),
        log=lambda msg: print(msg, file=sys.stderr),
    )
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    if foreground:
        (workdir / "supervisor.json").write_text(json.dumps({"pid": os.getpid()}))
        return _supervise(workdir, real_node)
    with open(workdir / "supervisor.log", "ab") as out:
        popen = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "_supervise",
                "--workdir",
                str(workdir),
                *(["--real-node"] if real_node else []),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (workdir / "supervisor.json").write_text(json.dumps({"pid": popen.pid}))
    deadline = time.monotonic() + timeout
    while not (workdir / "state.json").exists():
        if popen.poll() is not None or time.monotonic() > deadline:
            try:
                error = (workdir / "error.txt").read_text()
            except OSError:  # none written, or the work dir is gone
                error = ""
            print(
                f"error: control plane did not start: {error or 'see ' + str(workdir / 'supervisor.log')}",
                file=sys.stderr,
            )
            cmd_down(workdir)
            return 1
        time.sleep(0.2)
    state = json.loads((workdir / "state.json").read_text())
    print(
        f"control plane up in {state['start_seconds']}s (server {state['server']}); stop with: "
        f"{Path(__file__).name} down",
        file=sys.stderr,
    )
    print(state["kubeconfig"])
    return 0


def cmd_down(workdir: Path) -> int:
    pid = _running_pid(workdir)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)  # the supervisor stops its components, then exits
            if not _wait_pid(pid, 30):
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # belt and braces: any component still alive (e.g. the supervisor was SIGKILLed)
    try:
        pids = json.loads((workdir / "pids.json").read_text())
    except (OSError, ValueError):
        pids = {}
    for comp_pid in pids.values():
        if _pid_alive(comp_pid):
            _stop_group(comp_pid, lambda t, p=comp_pid: _wait_pid(p, t))
    if (workdir / "node.json").exists():  # a real node whose supervisor could not sweep it
        sys.path.insert(0, str(CLUSTER_DIR))
        import realnode

        realnode.sweep(workdir)
        realnode.release_lock()
    (workdir / "supervisor.json").unlink(missing_ok=True)
    (workdir / "state.json").unlink(missing_ok=True)
    print("down", file=sys.stderr)
    return 0


def cmd_status(workdir: Path) -> int:
    pid = _running_pid(workdir)
    if not pid or not (workdir / "state.json").exists():
        print("not running")
        return 1
    cluster = KubeCluster.from_state(workdir)
    print(f"running (supervisor pid {pid}); server {cluster.server}; KUBECONFIG={cluster.kubeconfig}")
    result = cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product", check=False)
    print(result.stdout or result.stderr, end="")
    return 0 if result.returncode == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controlplane.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build (or reuse cached) binaries")
    p_build.add_argument(
        "names", nargs="*", help=f"components (default: all default ones) of {sorted(COMPONENTS)}"
    )
    for name, help_text in (
        ("up", "start a control plane; prints the KUBECONFIG path"),
        ("down", "stop it; leaves no process or port"),
        ("status", "is it running? lists the nodes"),
        ("_supervise", argparse.SUPPRESS),
    ):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--workdir", type=Path, default=WORK_ROOT / "default")
        if name in ("up", "_supervise"):
            p.add_argument(
                "--real-node", action="store_true", help="also run a real node (scripts/dev-cluster)"
            )
        if name == "up":
            p.add_argument("--foreground", action="store_true", help="run in this process until Ctrl-C")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            for name, directory in build(args.names, log=lambda msg: print(msg, file=sys.stderr)).items():
                print(f"{name}: {directory}")
            return 0
        workdir = args.workdir.resolve()
        if args.command == "up":
            return cmd_up(workdir, args.foreground, args.real_node)
        if args.command == "down":
            return cmd_down(workdir)
        if args.command == "status":
            return cmd_status(workdir)
        return _supervise(workdir, args.real_node)
    except (BuildError, ControlPlaneError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
