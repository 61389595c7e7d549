"""A real node for the dev cluster: containerd + runc + CNI bridge + kubelet + kube-proxy + CoreDNS +
a local-path storage class + NetworkPolicy enforcement (kube-router's firewall), on this machine, beside
the control plane of controlplane.py (docs/dev-cluster.md).

kwok's fake GPU nodes fake their pods; this node runs them: images are built and loaded (nodeimages.py),
containers start under runc, pods get an IP on a bridge, Services work through kube-proxy's iptables
rules, names through CoreDNS, and NetworkPolicies through kube-router's network policy controller
(iptables + ipset; its router and service proxy are off). It needs root (network namespaces, mounts,
iptables) and the Debian packages in HOST_PACKAGES (`ensure_host_packages` installs them). One real node
per machine: its bridge and addresses are fixed (a lock file says who holds them).

This VM's quirks, each handled here and named in docs/dev-cluster.md:
- cgroup v1: kubelet needs `failCgroupV1: false` (and the cgroupfs driver: no systemd);
- no CAP_SYS_RESOURCE: runc cannot set the pod sandbox's negative oom_score_adj ("can't get final
  child's PID from pipe: EOF"), so containerd runs runc through RUNC_WRAPPER, which clamps a negative
  `process.oomScoreAdj` to 0 in the bundle's config.json;
- nothing can be pulled from an image registry: the pause image is a static C program and every other
  image is built here too (nodeimages.py);
- no nftables `queue` expression (CONFIG_NFT_QUEUE is not set): kube-network-policies, the NetworkPolicy
  implementation kind ships, cannot load its rules, so the policies are kube-router's (iptables, ipset).

`stop` leaves no process, mount, network namespace, bridge, iptables rule or ipset behind (`sweep` does
the last part even after a crash, from what `start` recorded in node.json).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import nodeimages as images  # tests/cluster/nodeimages.py (this folder is on sys.path: see controlplane.py)
import yaml
from support.manifests import RBAC, role_and_binding  # tests/ is on sys.path too (controlplane.py)

NODE_NAME = "dev-node"
BRIDGE = "rlfleet0"
POD_SUBNET = ipaddress.ip_network("10.88.0.0/24")
NODE_IP = str(next(POD_SUBNET.hosts()))  # the bridge's address: the API server, kubelet and DNS listen here
CLUSTER_DOMAIN = "cluster.local"
NODE_LABELS = {"rlfleet.dev/dev-node": "true"}
STORAGE_CLASS = "local-path"
STORAGE_NAMESPACE = "local-path-storage"
STORAGE_SERVICE_ACCOUNT = "local-path-provisioner-service-account"
STORAGE_PROVISIONER = "rancher.io/local-path"
HOST_PACKAGES = {  # Debian package -> a binary it installs (what `ensure_host_packages` checks)
    "containerd": "containerd",
    "runc": "runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "iptables": "iptables",
    "ipset": "ipset",  # kube-router's NetworkPolicy controller keeps the policies' pod sets in ipsets
    "iproute2": "ip",
    "buildah": "buildah",
    "debootstrap": "debootstrap",
    "gcc": "gcc",
    "libc6-dev": "/usr/lib/x86_64-linux-gnu/libc.a",
    "busybox-static": "/bin/busybox",
}
CNI_BIN_DIR = Path("/usr/lib/cni")
NETNS_DIR = Path("/run/netns")
LOCK_FILE = Path("/run/rlfleet-dev-node.lock")

RUNC_WRAPPER = r"""#!/bin/sh
# containerd's runc for the dev node: this VM has no CAP_SYS_RESOURCE, so runc cannot set a negative
# oom_score_adj (pod sandboxes ask for -998). Clamp it to 0 in the bundle's config.json, then run runc.
bundle=""
prev=""
for arg in "$@"; do
  case "$prev" in --bundle|-b) bundle="$arg" ;; esac
  case "$arg" in --bundle=*) bundle="${arg#--bundle=}" ;; esac
  prev="$arg"
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  sed -i 's/"oomScoreAdj":-[0-9]*/"oomScoreAdj":0/' "$bundle/config.json"
fi
exec runc "$@"
"""


class NodeError(RuntimeError):
    pass


def host_problems() -> list[str]:
    """Why this machine cannot run the real node (empty: it can). Missing packages are not a reason
    when we are root: `ensure_host_packages` installs them."""
    problems = []
    if os.geteuid() != 0:
        problems.append("the real node needs root (network namespaces, mounts, iptables)")
    if not Path("/sys/fs/cgroup").is_dir():
        problems.append("no /sys/fs/cgroup")
    if not Path("/proc/sys/net/ipv4/ip_forward").exists():
        problems.append("no IPv4 forwarding sysctl")
    return problems


def missing_packages() -> list[str]:
    return [pkg for pkg, probe in HOST_PACKAGES.items() if not (shutil.which(probe) or Path(probe).exists())]


def ensure_host_packages(log: Callable[[str], None] = print) -> None:
    """apt-get install what the node needs (Debian packages; root only), unless it is all there."""
    missing = missing_packages()
    if not missing:
        return
    if os.geteuid() != 0:
        raise NodeError(
            f"missing Debian packages {missing}: run as root or `apt-get install {' '.join(missing)}`"
        )
    log(f"installing Debian packages {missing} ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
    ):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise NodeError(f"{' '.join(cmd)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


# --------------------------------------------------------------------------------------------------
# What `start` changes on the host, and how `sweep` takes it back.
# --------------------------------------------------------------------------------------------------


def _mounts() -> list[str]:
    """Mount points, deepest first (mountinfo's 5th field, octal escapes decoded)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        points.append(re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), point))
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def _netns() -> set[str]:
    return {p.name for p in NETNS_DIR.glob("cni-*")} if NETNS_DIR.is_dir() else set()


def _iptables_chains(binary: str) -> dict[str, list[str]]:
    """table -> chain names of this node (KUBE-*, CNI-*)."""
    result = _run(f"{binary}-save", check=False)
    chains: dict[str, list[str]] = {}
    table = ""
    for line in result.stdout.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and re.match(r":(KUBE-|CNI-)", line):
            chains.setdefault(table, []).append(line[1:].split()[0])
    return chains


def _sweep_iptables() -> None:
    """Delete every rule that jumps to a KUBE-/CNI- chain, then those chains (iptables and ip6tables)."""
    for binary in ("iptables", "ip6tables"):
        if not shutil.which(binary):
            continue
        chains = _iptables_chains(binary)
        saved = _run(f"{binary}-save", check=False).stdout
        table = ""
        for line in saved.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif (
                line.startswith("-A ")
                and re.search(r" -j (KUBE-|CNI-)", line)
                and not re.match(r"-A (KUBE-|CNI-)", line)
            ):
                _run(binary, "-w", "-t", table, *shlex.split(line.replace("-A ", "-D ", 1)), check=False)
        for table, names in chains.items():
            for name in names:
                _run(binary, "-w", "-t", table, "-F", name, check=False)
            for name in names:
                _run(binary, "-w", "-t", table, "-X", name, check=False)


def _ipsets() -> list[str]:
    """This node's ipsets (kube-router's KUBE-SRC-*/KUBE-DST-*, inet6:KUBE-* for IPv6)."""
    if not shutil.which("ipset"):
        return []
    names = _run("ipset", "list", "-n", check=False).stdout.split()
    return [name for name in names if re.match(r"(inet6:)?KUBE-", name)]


def _sweep_ipsets() -> None:
    """Destroy them (after `_sweep_iptables`: an ipset a rule still refers to cannot be destroyed)."""
    for name in _ipsets():
        _run("ipset", "destroy", name, check=False)


def _descendants(pids: set[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _processes_naming(text: str) -> set[int]:
    """Processes whose command line mentions `text` (e.g. our containerd socket: its shims)."""
    pids = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.add(int(cmdline.parent.name))
        except OSError:
            continue
    pids.discard(os.getpid())
    return pids


def sweep(workdir: Path, log: Callable[[str], None] = lambda msg: None) -> None:
    """Take back everything the node put on the host: container processes (the shims of our containerd
    and their children), mounts under `workdir`, the network namespaces it made, iptables rules and
    ipsets, the bridge. Safe to run twice, and after a crash."""
    state = _read_state(workdir)
    shims = _processes_naming(str(workdir / "node" / "containerd"))  # RealNode.dir / containerd
    for pid in _descendants(shims):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in _mounts():
        if point.startswith(str(workdir) + "/") or (
            point.startswith(str(NETNS_DIR) + "/")
            and Path(point).name not in state.get("netns_before", [])
            and Path(point).name.startswith("cni-")
        ):
            _run("umount", "-l", point, check=False)
    for name in _netns() - set(state.get("netns_before", [])):
        (NETNS_DIR / name).unlink(missing_ok=True)
    _sweep_iptables()
    _sweep_ipsets()
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "delete", BRIDGE, check=False)
    for veth in Path("/sys/class/net").glob("veth*"):  # pod ends left by a netns that outlived its pod
        try:
            master = os.readlink(veth / "master")
        except OSError:  # not on a bridge, or gone since the listing (its netns went)
            continue
        if Path(master).name == BRIDGE:
            _run("ip", "link", "delete", veth.name, check=False)
    for cgroup in Path("/sys/fs/cgroup").glob("*/kubepods*"):  # empty after the kill above
        _remove_tree_bottom_up(cgroup)
    log("node swept")


def _remove_tree_bottom_up(root: Path) -> None:
    """rmdir every directory under `root`, then `root`. A cleanup never raises on what is missing: one
    that vanished meanwhile (the kubelet, or another sweep, removed it) or is still busy is left."""
    for parent, children, _ in os.walk(root, topdown=False):  # os.walk skips what it cannot list
        for child in children:
            try:
                os.rmdir(os.path.join(parent, child))
            except OSError:
                pass
    try:
        root.rmdir()
    except OSError:
        pass


def _read_state(workdir: Path) -> dict[str, Any]:
    try:
        return json.loads((workdir / "node.json").read_text())
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------------------------------
# The node.
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodePorts:
    kubelet: int
    kubelet_healthz: int
    proxy_healthz: int
    proxy_metrics: int
    dns_health: int
    dns_ready: int
    router_health: int


class RealNode:
    """The node's processes and host state. ControlPlane (controlplane.py) calls `prepare_host` before
    the API server (the bridge it listens on), `start` after it (with its `spawn_process`: same logs, same
    process-group handling, and its admin `kubectl`), `drain` and `sweep` when it stops."""

    def __init__(self, workdir: Path, log: Callable[[str], None] = lambda msg: None) -> None:
        self.workdir = Path(workdir)
        self.dir = self.workdir / "node"
        self.log = log
        self.ip = NODE_IP
        self.name = NODE_NAME
        self.kubectl: Callable[..., subprocess.CompletedProcess] = _not_started
        self.wait: Callable[[str, Callable[[], bool], float], None] = _not_started
        self.ports: NodePorts | None = None
        self.procs: list[Any] = []  # controlplane.Proc of the node's processes (the control plane stops them)

    @staticmethod
    def client_certs() -> dict[str, tuple[str, str | None]]:
        """Client certificates the control plane issues for the node: file -> (CN, O). The kubelet is
        `system:node:<name>` in `system:nodes` (the Node authorizer and NodeRestriction apply to it)."""
        return {
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", None),
            "kube-router": ("system:kube-router", None),  # bound to KUBE_ROUTER_RULES (kube_router_rbac)
            "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
        }

    # ---- before the API server: the bridge it listens on ----
    def prepare_host(self) -> None:
        problems = host_problems()
        if problems:
            raise NodeError("; ".join(problems))
        ensure_host_packages(self.log)
        self.dir.mkdir(parents=True, exist_ok=True)
        if not LOCK_FILE.exists() and (
            any(_iptables_chains(b) for b in ("iptables", "ip6tables")) or _ipsets()
        ):
            # never ours (a node of ours leaves its lock until swept): the sweep would delete them
            raise NodeError(
                "this machine already has KUBE-*/CNI-* iptables chains or KUBE-* ipsets (a kubelet, "
                "kube-proxy or kube-router of another cluster?): the dev cluster's cleanup would delete "
                "them, so it does not start"
            )
        _take_lock()
        sweep(self.workdir)  # a previous node of ours that died without `down`
        (self.workdir / "node.json").write_text(json.dumps({"netns_before": sorted(_netns())}))
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_IP}/{POD_SUBNET.prefixlen}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        bridge_nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if bridge_nf.exists():
            bridge_nf.write_text("1")

    # ---- after the API server ----
    def start(
        self,
        spawn_process: Callable[..., Any],
        wait: Callable[[str, Callable[[], bool], float], None],
        bin_dir: Path,
        pki: Path,
        kubectl: Callable[..., subprocess.CompletedProcess],
        free_port: Callable[[], int],
        service_cidr: str,
    ) -> None:
        """Start the node's processes (the control plane has written the kubeconfigs of `client_certs`
        into `self.dir`) and wait for the node to be Ready, its NetworkPolicy firewall installed and DNS to
        answer. `wait(what, check, timeout)` is the control plane's poll: it fails at once, with the log,
        when one of its processes (the node's among them) died."""
        ports = NodePorts(*(free_port() for _ in range(7)))
        self.ports = ports
        self.kubectl = kubectl
        self.wait = wait

        def spawn_node_process(name: str, argv: list[str]) -> None:
            self.procs.append(spawn_process(name, argv))

        spawn = spawn_node_process
        containerd_sock = self._start_containerd(spawn)
        self.load_images([images.pause_image(self.log), images.helper_image(self.log)])
        self._start_kubelet(spawn, bin_dir, pki, containerd_sock, ports)
        self._start_kube_proxy(spawn, bin_dir, ports)
        self.wait("node Ready", self._node_ready, 120)
        self._start_kube_router(spawn, bin_dir, ports, service_cidr)
        self._start_coredns(spawn, bin_dir, ports)
        self._start_storage(spawn, bin_dir)
        self.wait("CoreDNS ready", lambda: _http_ok(f"http://127.0.0.1:{ports.dns_ready}/ready"), 60)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(
            "ctr",
            "--address",
            str(self.dir / "containerd" / "containerd.sock"),
            "-n",
            "k8s.io",
            *args,
            check=check,
        )

    def _start_containerd(self, spawn: Callable[..., Any]) -> Path:
        d = self.dir
        (d / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        wrapper = d / "runc-oom-clamp"
        wrapper.write_text(RUNC_WRAPPER)
        wrapper.chmod(0o755)
        sock = d / "containerd" / "containerd.sock"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{d}/containerd/root"
state = "{d}/containerd/state"
[grpc]
  address = "{sock}"
[{cri}]
  sandbox_image = "{images.PAUSE_IMAGE}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{wrapper}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{d}/cni/net.d"
"""
        (d / "containerd.toml").write_text(config)
        (d / "cni" / "net.d" / "10-rlfleet.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "rlfleet",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": str(POD_SUBNET), "gateway": NODE_IP}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(d / "cni" / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                        {"type": "loopback"},
                    ],
                },
                indent=2,
            )
        )
        spawn(
            "containerd", [shutil.which("containerd") or "containerd", "--config", str(d / "containerd.toml")]
        )
        self.wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 60)
        return sock

    def load_images(self, built: list[Any]) -> None:
        """Import OCI archives (nodeimages.py) into the node's containerd, where pods find them by tag."""
        for image in built:
            self.ctr("images", "import", str(image.archive))

    def _start_kubelet(self, spawn, bin_dir: Path, pki: Path, sock: Path, ports: NodePorts) -> None:
        d = self.dir
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,  # this VM is cgroup v1
            "cgroupDriver": "cgroupfs",  # no systemd here
            "containerRuntimeEndpoint": f"unix://{sock}",
            "address": NODE_IP,
            "port": ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": ports.kubelet_healthz,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki / "ca.crt")},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": CLUSTER_DOMAIN,
            "clusterDNS": [NODE_IP],
            "podCIDR": str(POD_SUBNET),
            "podLogsDir": str(d / "pod-logs"),
            "failSwapOn": False,
            "serializeImagePulls": False,
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "protectKernelDefaults": False,
            "staticPodPath": "",
            "resolvConf": str(self._resolv_conf()),
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "registerNode": True,
            "maxPods": 110,
        }
        (d / "kubelet.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        labels = ",".join(f"{k}={v}" for k, v in NODE_LABELS.items())
        spawn(
            "kubelet",
            [
                str(bin_dir / "kubelet"),
                f"--config={d / 'kubelet.yaml'}",
                f"--kubeconfig={d / 'kubelet.kubeconfig'}",
                f"--root-dir={d / 'kubelet'}",
                f"--cert-dir={d / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}",
                f"--node-labels={labels}",
                "--v=1",
            ],
        )

    def _resolv_conf(self) -> Path:
        """Pods with dnsPolicy Default get this: no upstream resolver (the node serves cluster names only)."""
        path = self.dir / "resolv.conf"
        path.write_text(f"nameserver {NODE_IP}\n")
        return path

    def _start_kube_proxy(self, spawn, bin_dir: Path, ports: NodePorts) -> None:
        d = self.dir
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(d / "kube-proxy.kubeconfig")},
            "mode": "iptables",
            "clusterCIDR": str(POD_SUBNET),
            "hostnameOverride": NODE_NAME,
            "bindAddress": NODE_IP,
            "healthzBindAddress": f"127.0.0.1:{ports.proxy_healthz}",
            "metricsBindAddress": f"127.0.0.1:{ports.proxy_metrics}",
            "conntrack": {"maxPerCore": 0, "min": 0},  # leave the host's conntrack table alone
            "iptables": {"masqueradeAll": True},
        }
        (d / "kube-proxy.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        spawn("kube-proxy", [str(bin_dir / "kube-proxy"), f"--config={d / 'kube-proxy.yaml'}", "--v=1"])

    def _start_kube_router(self, spawn, bin_dir: Path, ports: NodePorts, service_cidr: str) -> None:
        """kube-router's network policy controller alone, as a host process (as its DaemonSet runs it, with
        the host's network): NetworkPolicies of the pods on this node become iptables chains (KUBE-ROUTER-*,
        KUBE-POD-FW-*, KUBE-NWPLCY-*) and ipsets (KUBE-SRC-*, KUBE-DST-*); traffic a policy does not allow
        is REJECTed. It needs the Node object (after the kubelet registered it). Waits until its chains hook
        the host's FORWARD, INPUT and OUTPUT chains."""
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(kube_router_rbac()))
        spawn(
            "kube-router",
            [
                str(bin_dir / "kube-router"),
                f"--kubeconfig={self.dir / 'kube-router.kubeconfig'}",
                f"--hostname-override={NODE_NAME}",
                "--run-firewall=true",
                "--run-router=false",  # the bridge CNI routes the pods
                "--run-service-proxy=false",  # kube-proxy serves the Services
                "--enable-cni=false",
                f"--service-cluster-ip-range={service_cidr}",
                f"--health-port={ports.router_health}",
                "--metrics-port=0",
                "--v=1",
            ],
        )

        def hooked() -> bool:
            rules = _run("iptables-save", "-t", "filter").stdout
            return all(f"-j KUBE-ROUTER-{hook}" in rules for hook in ("FORWARD", "INPUT", "OUTPUT"))

        self.wait("kube-router's NetworkPolicy chains", hooked, 60)

    def _start_coredns(self, spawn, bin_dir: Path, ports: NodePorts) -> None:
        d = self.dir
        corefile = f""".:53 {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{ports.dns_health}
    ready 127.0.0.1:{ports.dns_ready}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {self.workdir / "kubeconfig"} rlfleet-test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
    loadbalance
}}
"""
        (d / "Corefile").write_text(corefile)
        spawn("coredns", [str(bin_dir / "coredns"), "-conf", str(d / "Corefile")])

    def _start_storage(self, spawn, bin_dir: Path) -> None:
        """local-path-provisioner as a host process, configured as its upstream manifest does: PVCs of
        the default class `local-path` get a directory under the node's storage dir, made (mode 0777) and
        removed by helper pods (images.HELPER_IMAGE)."""
        storage = self.dir / "storage"
        storage.mkdir(exist_ok=True)
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(storage_manifests(storage)))
        spawn(
            "local-path-provisioner",
            [
                str(bin_dir / "local-path-provisioner"),
                "start",
                f"--kubeconfig={self.workdir / 'kubeconfig'}",
                f"--namespace={STORAGE_NAMESPACE}",
                "--configmap-name=local-path-config",
                f"--service-account-name={STORAGE_SERVICE_ACCOUNT}",
                f"--helper-image={images.HELPER_IMAGE}",
                f"--provisioner-name={STORAGE_PROVISIONER}",
            ],
        )

    def _node_ready(self) -> bool:
        node = json.loads(self.kubectl("get", "node", NODE_NAME, "-o", "json").stdout)
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", [])
        )

    # ---- teardown ----
    def sweep(self) -> None:
        sweep(self.workdir, self.log)
        release_lock()  # only now: a lock left by a crash marks the host's KUBE-/CNI- rules as ours

    def drain(self, timeout: float = 60) -> None:
        """Delete every pod bound to the node while the API server is still up, so the kubelet tears
        them down properly (CNI DEL, unmounts), and wait until containerd runs no task."""
        self.kubectl(
            "delete",
            "pods",
            "-A",
            "--field-selector",
            f"spec.nodeName={NODE_NAME}",
            "--grace-period=0",
            "--force",
            "--wait=false",
            check=False,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tasks = self.ctr("tasks", "ls", "-q", check=False)
            if tasks.returncode != 0 or not tasks.stdout.strip():
                return
            time.sleep(0.5)
        self.log(f"node: tasks still running after {timeout:.0f}s; the sweep kills them")


KUBE_ROUTER_RULES: list[dict[str, Any]] = [  # its upstream ClusterRole, less what the router and proxy need
    {
        "apiGroups": [""],
        "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
]


def kube_router_rbac() -> list[dict[str, Any]]:
    """What kube-router's client certificate (user system:kube-router, `client_certs`) may read."""
    user = {"apiGroup": RBAC, "kind": "User", "name": "system:kube-router"}
    return role_and_binding("rlfleet-dev-kube-router", KUBE_ROUTER_RULES, user, cluster_wide=True)


def storage_manifests(storage: Path) -> list[dict[str, Any]]:
    """The objects of local-path-provisioner's upstream manifest that a host process needs."""
    helper_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "helper-pod"},
        "spec": {
            "tolerations": [
                {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "containers": [{"name": "helper-pod", "image": images.HELPER_IMAGE, "imagePullPolicy": "Never"}],
        },
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": STORAGE_NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": STORAGE_SERVICE_ACCOUNT, "namespace": STORAGE_NAMESPACE},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "local-path-config", "namespace": STORAGE_NAMESPACE},
            "data": {
                "config.json": json.dumps(
                    {"nodePathMap": [{"node": "DEFAULT_PATH_FOR_NON_LISTED_NODES", "paths": [str(storage)]}]}
                ),
                "setup": '#!/bin/sh\nset -eu\nmkdir -m 0777 -p "$VOL_DIR"\n',
                "teardown": '#!/bin/sh\nset -eu\nrm -rf "$VOL_DIR"\n',
                "helperPod.yaml": yaml.safe_dump(helper_pod, sort_keys=False),
            },
        },
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": STORAGE_PROVISIONER,
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Delete",
        },
    ]


def _not_started(*args: Any, **kwargs: Any) -> NoReturn:
    raise NodeError("the node is not started")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def _take_lock() -> None:
    """One real node per machine (fixed bridge and addresses): refuse a second one while the first's
    owner lives."""
    try:
        owner = int(LOCK_FILE.read_text())
    except (OSError, ValueError):
        owner = 0
    if owner and owner != os.getpid() and Path(f"/proc/{owner}").exists():
        raise NodeError(
            f"a dev-cluster node is already running (pid {owner}); stop it with scripts/dev-cluster down"
        )
    LOCK_FILE.write_text(str(os.getpid()))


def release_lock() -> None:
    """After a sweep: ours, or left by an owner that died (down after a crash)."""
    try:
        owner = int(LOCK_FILE.read_text())
    except (OSError, ValueError):
        return
    if owner == os.getpid() or not Path(f"/proc/{owner}").exists():
        LOCK_FILE.unlink(missing_ok=True)
