"""Pods that really run on the dev cluster's real node: the images as built from images/Dockerfile.*, one
uid, read-only root file systems, pod networking, Services, cluster DNS, the API server from a pod,
volumes from the storage class, probes, logs; and a node that leaves nothing behind.

The last test stops the cluster (the session fixture's stop is then a no-op) and checks the host.
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import realnode
from support.operator_chart import install_operator_chart, uninstall_operator_chart
from support.waits import wait_for

# a cold session builds the images in its first test's setup (scripts/test builds them before pytest)
pytestmark = [pytest.mark.node, pytest.mark.cluster, pytest.mark.timeout(1800)]

UID = 10001  # the one uid of every rlfleet image and pod (images/README.md)


def restricted_container(name: str, image: str, command: list[str], **extra: Any) -> dict[str, Any]:
    """A container as the operator builds them: non-root uid 10001, read-only root, no privilege."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "Never",  # nothing can be pulled here: the node has what `images` loaded
        "command": command,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
        **extra,
    }


def pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"rlfleet.dev/dev-node": "true"},
            "restartPolicy": "Never",
            "containers": containers,
            "volumes": [{"name": "tmp", "emptyDir": {}}],
            **spec,
        },
    }


def apply(kube, *objects: dict[str, Any], namespace: str) -> None:
    kube.kubectl("apply", "-n", namespace, "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def wait_phase(kube, namespace: str, name: str, phases: set[str], timeout: float = 180) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = kube.get_json("pod", name, "-n", namespace)
        phase = obj["status"].get("phase")
        if phase == "Failed" and "Failed" not in phases:
            raise AssertionError(
                f"pod {name} failed: {json.dumps(obj['status'])[:2000]}\n"
                f"{kube.kubectl('logs', '-n', namespace, name, check=False).stdout}"
            )
        return obj if phase in phases else None

    try:
        return wait_for(f"pod {name} in {sorted(phases)}", check, timeout=timeout)
    except AssertionError:
        events = kube.kubectl("get", "events", "-n", namespace, "-o", "wide", check=False).stdout
        raise AssertionError(f"pod {name} never reached {sorted(phases)}; events:\n{events}") from None


def logs(kube, namespace: str, name: str, container: str | None = None) -> str:
    args = ["logs", "-n", namespace, name] + (["-c", container] if container else [])
    return kube.kubectl(*args).stdout


# --------------------------------------------------------------------------------------------------


def test_the_node_is_a_real_kubelet_on_containerd(dev_cluster) -> None:
    node = dev_cluster.kube.get_json("node", realnode.NODE_NAME)
    info = node["status"]["nodeInfo"]
    assert info["containerRuntimeVersion"].startswith("containerd://"), info
    assert info["kubeletVersion"] == "v1.36.3"
    assert {"type": "InternalIP", "address": realnode.NODE_IP} in node["status"]["addresses"]
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", ready
    # kwok's fake GPU nodes stay beside it for scheduling tests
    fake = [
        n
        for n in dev_cluster.kube.get_json("nodes")["items"]
        if n["metadata"].get("annotations", {}).get("kwok.x-k8s.io/node") == "fake"
    ]
    assert any("nvidia.com/gpu.product" in n["metadata"]["labels"] for n in fake)


@pytest.mark.parametrize("image", ["operator", "sampler", "trainer"])
def test_each_image_runs_as_uid_10001_on_a_read_only_root(dev_cluster, ns: str, image: str) -> None:
    """The images built from images/Dockerfile.* start, as the one uid, with nothing writable but /tmp;
    `kubectl logs` reads them. The trainer's CPU build carries torch and megatron-core, the sampler's
    the reference engine."""
    kube = dev_cluster.kube
    ref = dev_cluster.images[image].ref
    probe = {
        "operator": "import rlfleet.operator, kopf; print('kopf', kopf.__version__)",
        "sampler": "import torch, rlfleet.sampler.reference_engine; print('torch', torch.__version__)",
        # torchrun (the trainer pod's command) must see rlfleet, and its ranks must form a gloo group
        # through its c10d rendezvous and their env:// stores (as the trainer's ranks do)
        "trainer": "import shutil, subprocess, torch, megatron.core, rlfleet.trainer.backends.backend_megatron;"
        "print('torchrun', shutil.which('torchrun'));"
        # each rank's line in ONE write(2) (atomic on the pipe; print's pieces interleaved once)
        "open('/tmp/ranks.py', 'w').write(\"import os, torch, torch.distributed as d; d.init_process_group('gloo');"
        " t = torch.ones(1); d.all_reduce(t); os.write(1, ('all_reduce %d' % int(t.item()) + chr(10)).encode());"
        ' d.destroy_process_group()");'
        "r = subprocess.run(['torchrun', '--standalone', '--nproc-per-node=2', '/tmp/ranks.py'],"
        " capture_output=True, text=True); print(r.stdout, r.stderr[-3000:]);"
        "print('megatron', megatron.core.__version__)",
    }[image]
    python = "/opt/rlfleet/bin/python" if image == "operator" else "python3"
    script = (
        "import os, sys; print('uid', os.getuid(), 'gid', os.getgid());"
        "open('/tmp/ok', 'w').write('x');"
        "\ntry:\n    open('/root-write-test', 'w')\nexcept OSError as e:\n    print('root fs:', e.strerror)\n"
        f"{probe}"
    )
    name = f"img-{image}"
    apply(
        kube,
        pod(
            name,
            [
                restricted_container(
                    name, ref, [python, "-c", script], volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}]
                )
            ],
        ),
        namespace=ns,
    )
    wait_phase(kube, ns, name, {"Succeeded"}, timeout=300)
    out = logs(kube, ns, name)
    assert f"uid {UID} gid {UID}" in out, out
    assert "root fs: Read-only file system" in out, out
    assert {"operator": "kopf ", "sampler": "torch ", "trainer": "megatron "}[image] in out, out
    if image == "trainer":
        assert "torchrun /opt/venv/bin/torchrun" in out, out
        assert out.count("all_reduce 2") == 2, out  # both ranks summed over the group
    entrypoint = restricted_container("v", ref, [], args=["--version"])  # ENTRYPOINT ["rlfleet"]
    del entrypoint["command"]
    apply(kube, pod(f"{name}-entrypoint", [entrypoint]), namespace=ns)
    wait_phase(kube, ns, f"{name}-entrypoint", {"Succeeded"})
    assert re.search(r"\d+\.\d+\.\d+", logs(kube, ns, f"{name}-entrypoint")), (
        "rlfleet --version printed no version"
    )


def test_pods_reach_each_other_through_a_service_by_dns_name(dev_cluster, ns: str) -> None:
    """Bridge CNI (a pod IP on the node's subnet), kube-proxy's Service rules and CoreDNS: a client pod
    fetches from a server pod by the Service's cluster DNS name; the server's readiness probe passes."""
    kube = dev_cluster.kube
    image = dev_cluster.images["operator"].ref
    python = "/opt/rlfleet/bin/python"
    server = restricted_container(
        "server",
        image,
        [python, "-m", "http.server", "8080", "--directory", "/tmp"],
        ports=[{"containerPort": 8080}],
        readinessProbe={"httpGet": {"path": "/hello.txt", "port": 8080}, "periodSeconds": 1},
        volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}],
    )
    writer = restricted_container(
        "writer",
        image,
        ["sh", "-c", "echo hello-from-the-server > /tmp/hello.txt"],
        volumeMounts=[{"name": "tmp", "mountPath": "/tmp"}],
    )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    apply(kube, pod("web", [server], initContainers=[writer], restartPolicy="Always"), service, namespace=ns)
    web = wait_for(
        "web Ready",
        lambda: (
            (o := kube.get_json("pod", "web", "-n", ns))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in o["status"].get("conditions", []))
            and o
        ),
        timeout=180,
    )
    assert ipaddress.ip_address(web["status"]["podIP"]) in realnode.POD_SUBNET
    url = f"http://web.{ns}.svc.cluster.local/hello.txt"
    client = restricted_container(
        "client",
        image,
        [
            python,
            "-c",
            f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())",
        ],
    )
    apply(kube, pod("client", [client]), namespace=ns)
    wait_phase(kube, ns, "client", {"Succeeded"})
    assert "hello-from-the-server" in logs(kube, ns, "client")


def test_a_pod_reaches_the_api_server_with_its_service_account(dev_cluster, ns: str) -> None:
    """What the operator's pod does: in-cluster config (KUBERNETES_SERVICE_HOST, the projected token and
    CA) through the `kubernetes` Service."""
    kube = dev_cluster.kube
    image = dev_cluster.images["operator"].ref
    script = (
        "import os, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "req = urllib.request.Request('https://kubernetes.default.svc/version',"
        " headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "print(urllib.request.urlopen(req, context=ctx, timeout=10).read().decode())\n"
    )
    apply(
        kube,
        pod("api", [restricted_container("api", image, ["/opt/rlfleet/bin/python", "-c", script])]),
        namespace=ns,
    )
    wait_phase(kube, ns, "api", {"Succeeded"})
    assert json.loads(logs(kube, ns, "api"))["gitVersion"] == "v1.36.3"


def test_a_volume_claim_of_the_default_class_outlives_its_pod(dev_cluster, ns: str) -> None:
    """local-path storage: a PVC binds when its first pod is scheduled, uid 10001 writes to it, a second
    pod reads what the first wrote."""
    kube = dev_cluster.kube
    image = dev_cluster.images["operator"].ref
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "16Mi"}}},
    }
    volume = {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}
    mount = [{"name": "data", "mountPath": "/data"}]
    writer = restricted_container(
        "w", image, ["sh", "-c", "id -u > /data/who && echo kept > /data/file"], volumeMounts=mount
    )
    apply(kube, claim, pod("writer", [writer], volumes=[volume]), namespace=ns)
    wait_phase(kube, ns, "writer", {"Succeeded"}, timeout=240)
    pvc = kube.get_json("pvc", "data", "-n", ns)
    assert pvc["status"]["phase"] == "Bound" and pvc["spec"]["storageClassName"] == realnode.STORAGE_CLASS
    kube.kubectl("delete", "pod", "writer", "-n", ns, "--wait=true")
    reader = restricted_container("r", image, ["sh", "-c", "cat /data/who /data/file"], volumeMounts=mount)
    apply(kube, pod("reader", [reader], volumes=[volume]), namespace=ns)
    wait_phase(kube, ns, "reader", {"Succeeded"})
    assert logs(kube, ns, "reader").split() == [str(UID), "kept"]


def test_the_chart_installs_an_operator_that_reconciles_an_rljob(dev_cluster, ns: str) -> None:
    """`helm install` of charts/rlfleet with its own RBAC (peering on): the operator pod starts as uid
    10001 on a read-only root, passes its liveness probe, and from inside the cluster (its ServiceAccount,
    the `kubernetes` Service) reconciles an RLJob: children created, status written with a reason."""
    kube = dev_cluster.kube
    release_ns = f"{ns}-op"
    operator_image = dev_cluster.images["operator"].ref
    install = install_operator_chart(
        kube, operator_image, release_ns, "--wait", "--timeout", "5m", timeout=400
    )
    try:
        assert install.returncode == 0, install.stdout + install.stderr
        [op] = kube.get_json("pods", "-n", release_ns, "-l", "app.kubernetes.io/name=rlfleet")["items"]
        assert op["spec"]["nodeName"] == realnode.NODE_NAME
        assert op["spec"]["securityContext"]["runAsUser"] == UID
        assert all(c["ready"] for c in op["status"]["containerStatuses"]), op["status"]
        job = {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "tiny"},
            "spec": {
                "model": {"name": "tiny", "path": "/weights/models/tiny"},
                "trainer": {"accelerator": "b200", "gpusPerReplica": 1, "backend": "torch"},
                "samplerGroups": [
                    {"name": "h100-bf16", "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"}
                ],
                "router": {"image": operator_image},
                "weightChannel": {
                    "store": {"type": "filesystem", "path": "/weights/tiny", "volumeClaimName": "weights"}
                },
            },
        }
        apply(kube, job, namespace=ns)
        status = wait_for(
            "the RLJob's status from the in-cluster operator",
            lambda: (
                (s := kube.get_json("rljob", "tiny", "-n", ns).get("status", {}))
                and s.get("conditions")
                and s
            ),
            timeout=180,
        )

        # the children may come a moment after the first status (a fresh CRD's storage answers 429 while it
        # initialises, and the operator retries): wait for them, saying what the operator logged if not
        def group_made() -> dict[str, Any] | None:
            got = kube.kubectl("get", "samplergroup", "tiny-h100-bf16", "-n", ns, "-o", "json", check=False)
            return json.loads(got.stdout) if got.returncode == 0 else None

        try:
            group = wait_for("the SamplerGroup from the in-cluster operator", group_made, timeout=120)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n{status}\n{logs(kube, release_ns, op['metadata']['name'])[-6000:]}"
            ) from None
        assert group["metadata"]["ownerReferences"]
        wait_for(
            "the trainer StatefulSet",
            lambda: kube.get_json("statefulset", "tiny-trainer", "-n", ns),
            timeout=60,
        )
        reasons = {c.get("reason") for c in status["conditions"]}
        assert reasons - {None, ""}, status  # every condition says why, never a bare Pending
        assert '"GET /healthz HTTP/1.1" 200' in logs(
            kube, release_ns, op["metadata"]["name"]
        )  # the probe, logged
    finally:
        uninstall_operator_chart(kube, release_ns)
        kube.kubectl("delete", "namespace", release_ns, "--wait=false", check=False)


# --------------------------------------------------------------------------------------------------


def _host_snapshot(workdir: Path) -> dict[str, Any]:
    """What the node may leave on the host: processes of its binaries, mounts, network namespaces,
    links, iptables rules (both families), ipsets (kube-router's)."""
    names = (
        "containerd",
        "containerd-shim",
        "kubelet",
        "kube-proxy",
        "kube-router",
        "coredns",
        "local-path-provisioner",
        "pause",
    )
    processes = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, state = re.match(r"\d+ \((.*)\) (\S)", stat.read_text()).groups()
        except (OSError, AttributeError):
            continue
        if comm in names and state != "Z":  # an exited shim waits a moment for init to reap it
            processes.add((int(stat.parent.name), comm))
    rules = {}
    for binary in ("iptables-save", "ip6tables-save"):
        out = subprocess.run([binary], capture_output=True, text=True).stdout
        rules[binary] = sorted(line for line in out.splitlines() if re.search(r"KUBE-|CNI-", line))
    return {
        "processes": sorted(processes),
        "mounts": sorted(m for m in realnode._mounts() if str(workdir) in m or "/run/netns/cni-" in m),
        "netns": sorted(realnode._netns()),
        "links": sorted(p.name for p in Path("/sys/class/net").iterdir()),
        "iptables": rules,
        "ipsets": realnode._ipsets(),
    }


def test_down_leaves_no_process_mount_bridge_or_iptables_rule(dev_cluster) -> None:
    if dev_cluster.plane is None:
        pytest.skip("attached to a running dev cluster (RLFLEET_DEV_CLUSTER_WORKDIR): it is not ours to stop")
    workdir = dev_cluster.plane.workdir
    # a policy: kube-router keeps its pod sets in ipsets, which the sweep must destroy too
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "deny-all"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]},
    }
    dev_cluster.kube.kubectl("apply", "-n", "default", "-f", "-", input=json.dumps(policy))
    wait_for("kube-router's ipsets of the policy", lambda: realnode._ipsets() or None, timeout=60)
    during = _host_snapshot(workdir)
    assert realnode.BRIDGE in during["links"] and during["processes"], during  # the check can fail
    assert any(r.startswith(":KUBE-SERVICES") for r in during["iptables"]["iptables-save"])
    assert any(
        r.startswith(":KUBE-ROUTER-FORWARD") for r in during["iptables"]["iptables-save"]
    )  # the policies'
    assert any(p[1] == "kube-router" for p in during["processes"]), during["processes"]
    started = time.monotonic()
    dev_cluster.plane.stop()
    after = _host_snapshot(workdir)
    assert after["processes"] == [], after["processes"]
    assert after["mounts"] == [], after["mounts"]
    assert after["netns"] == [], after["netns"]
    assert realnode.BRIDGE not in after["links"] and not any(n.startswith("veth") for n in after["links"])
    assert after["iptables"] == {"iptables-save": [], "ip6tables-save": []}, after["iptables"]
    assert after["ipsets"] == [], after["ipsets"]
    print(f"stopped and swept in {time.monotonic() - started:.1f}s")
