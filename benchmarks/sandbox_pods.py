"""Sandbox pods (rlfleet/sandbox/pods.py) on the dev cluster's real node: acquire latency cold and warm,
and the tool-call round trip through the API server's exec, against the local bwrap backend
(rlfleet/sandbox/local.py) and plain `subprocess` on the host, in the same run.

    flock /tmp/node-tier.lock nice -n 10 .venv/bin/python benchmarks/sandbox_pods.py \
        [--cold 5] [--warm 10] [--calls 100] [--workdir DIR]

Root (the real node: containerd, kubelet). Without --workdir (or RLFLEET_DEV_CLUSTER_WORKDIR) it starts
the control plane with the real node in a scratch dir (tests/cluster/controlplane.py, as the node tier's
`dev_cluster` fixture does) and stops it at the end; with one, it attaches to a running
`scripts/dev-cluster up`. Either way the sandbox image (tests/cluster/nodeimages.py sandbox_image, cached)
is loaded into the node. The trainer here is this process, with the cluster admin's kubeconfig; its
"trainer pod" (the sandboxes' owner) is a busybox pod in a fresh namespace, deleted at the end.
Pods start from the node's local image (imagePullPolicy Never): no pull is ever timed.

- cold acquire: `PodSandboxes(warm_pool=0)(files)`: the pod created, scheduled, its container running
  (`start_seconds`: create -> running, polled every 250 ms as the backend does), then the snapshot
  (the files as a tar on one exec's stdin, `tar -x` + git init/add/commit: the sandbox's `seconds`).
  Then `close()` (the pod deleted, grace 0). Against `LocalSandbox(files)` (the same snapshot in bwrap)
  alternating with it.
- warm acquire: `PodSandboxes(warm_pool=1)`, one sandbox kept open (so the pool keeps one idle pod);
  each time the pool's pod is running, a new sandbox is taken from it (`warm` must be True: the timed
  part is the pool's hand-over and the snapshot exec), then closed.
- round trip: on one open pod sandbox, one local sandbox and the host, alternating: bash `true`
  (`Sandbox.run`), a file read (`read_file`), SweEnv's `edit` tool (read + write, its reply checked) and
  a file write (`write_file`) that undoes the edit. Each pod call is one exec: a websocket to the API
  server, which the kubelet forwards to containerd's streaming server.

The machine is shared: the load average is printed before and after; read the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import controlplane  # noqa: E402 - tests/cluster, put on sys.path just above
import nodeimages  # noqa: E402
import realnode  # noqa: E402
from sandbox import HostBox, loadavg, ms, pct, shipped_files  # noqa: E402 - benchmarks/sandbox.py
from support.waits import wait_for  # noqa: E402

from rlfleet.sandbox import SandboxLimits  # noqa: E402
from rlfleet.sandbox.local import LocalSandbox, bwrap_problem  # noqa: E402
from rlfleet.sandbox.pods import PodSandbox, PodSandboxes  # noqa: E402
from rlfleet.sandbox.podspec import SandboxPodConfig, owner_selector  # noqa: E402
from rlfleet.trainer.envs.swe_env import SweEnv  # noqa: E402

LIMITS = SandboxLimits(max_timeout_s=60)


def log(msg: str) -> None:
    print(f"[sandbox-pods] {msg}", file=sys.stderr, flush=True)


def owner_pod(kube: Any, namespace: str, name: str) -> str:
    """A running pod standing for the trainer pod; its uid (the sandboxes' ownerReference)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"rlfleet.dev/dev-node": "true"},
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "trainer",
                    "image": nodeimages.HELPER_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "86400"],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 10001,
                        "allowPrivilegeEscalation": False,
                    },
                }
            ],
        },
    }
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    kube.kubectl(
        "wait", "-n", namespace, "--for=jsonpath={.status.phase}=Running", f"pod/{name}", "--timeout=180s"
    )
    return str(kube.get_json("pod", name, "-n", namespace)["metadata"]["uid"])


def med(values: list[float]) -> str:
    return ms(statistics.median(values))


def acquire_and_round_trip(kube: Any, config: SandboxPodConfig, args: argparse.Namespace) -> None:
    files = shipped_files()
    cold: dict[str, list[float]] = {}
    factory = PodSandboxes(config, kubeconfig=str(kube.kubeconfig))
    try:
        for _ in range(args.cold):
            t = time.perf_counter()
            box = factory(files, LIMITS)
            total = time.perf_counter() - t
            assert not box.warm
            cold.setdefault("pod total", []).append(total)
            cold.setdefault("pod start", []).append(box.start_seconds)
            cold.setdefault("pod snapshot", []).append(box.seconds)
            t = time.perf_counter()
            box.close()
            cold.setdefault("pod close", []).append(time.perf_counter() - t)
            t = time.perf_counter()
            local = LocalSandbox(files, LIMITS)
            cold.setdefault("local total", []).append(time.perf_counter() - t)
            cold.setdefault("local snapshot", []).append(local.seconds)
            local.close()
            wait_for("the closed sandbox pod gone", lambda: not pods_of(kube, config) or None, timeout=120)
    finally:
        factory.shutdown()

    warm: dict[str, list[float]] = {}
    pool = PodSandboxes(dataclasses.replace(config, warm_pool=1), kubeconfig=str(kube.kubeconfig))
    try:
        anchor = pool(files, LIMITS)  # one open sandbox: the pool keeps one idle pod for it
        for _ in range(args.warm):
            wait_for("one idle pod in the pool", lambda: one_idle(pool) or None, timeout=180)
            t = time.perf_counter()
            box = pool(files, LIMITS)
            total = time.perf_counter() - t
            assert box.warm, "the pool's pod was not taken"
            warm.setdefault("pod total", []).append(total)
            warm.setdefault("pod start", []).append(box.start_seconds)
            warm.setdefault("pod snapshot", []).append(box.seconds)
            t = time.perf_counter()
            box.close()
            warm.setdefault("pod close", []).append(time.perf_counter() - t)
            t = time.perf_counter()
            local = LocalSandbox(files, LIMITS)
            warm.setdefault("local total", []).append(time.perf_counter() - t)
            warm.setdefault("local snapshot", []).append(local.seconds)
            local.close()
        times = round_trips(anchor, args.calls)
        anchor.close()
    finally:
        pool.shutdown()

    print(
        f"\nAcquire, ms (median; cold: {args.cold} acquires with no pool, warm: {args.warm} from a pool of 1), "
        "stats-mean (4 files, 0.5 kB)"
    )
    print(
        "| acquire | pod: total | of it pod start (create -> running; warm: taken from the pool) "
        "| of it snapshot exec | pod close | local: total | of it snapshot (bwrap + git) | pod / local |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in (("cold", cold), ("warm", warm)):
        ratio = statistics.median(rows["pod total"]) / statistics.median(rows["local total"])
        print(
            f"| {name} | {med(rows['pod total'])} | {med(rows['pod start'])} | {med(rows['pod snapshot'])} "
            f"| {med(rows['pod close'])} | {med(rows['local total'])} | {med(rows['local snapshot'])} "
            f"| {ratio:.1f}x |"
        )
    print(f"(cold pod total, each: {', '.join(ms(x) for x in cold['pod total'])})")
    print_round_trips(times, args.calls)


def one_idle(pool: PodSandboxes) -> bool:
    idle, warming, _ = pool.pool()
    return len(idle) == 1 and warming == 0


def pods_of(kube: Any, config: SandboxPodConfig) -> list[str]:
    items = kube.get_json("pods", "-n", config.namespace, "-l", owner_selector(config.owner_pod))["items"]
    return [p["metadata"]["name"] for p in items]


def round_trips(pod: PodSandbox, calls: int) -> dict[str, list[float]]:
    files = shipped_files()
    path = next(p for p in files if p.endswith("__init__.py") and files[p])
    content = files[path]
    local, host = LocalSandbox(files, LIMITS), HostBox(files)
    boxes: dict[str, Any] = {"pod": pod, "local": local, "host": host}
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t = time.perf_counter()
        fn()
        times.setdefault(name, []).append(time.perf_counter() - t)

    def edited(reply: str) -> None:
        assert reply == f"edited {path}", reply

    def run_true(box: Any) -> None:
        result = box.run("true", timeout_s=30) if not isinstance(box, HostBox) else box.run("true")
        code = result.returncode if isinstance(box, HostBox) else result.exit_code
        assert code == 0, result

    try:
        for _ in range(calls):
            for kind, box in boxes.items():
                timed(f"{kind} true", lambda b=box: run_true(b))
                timed(f"{kind} read", lambda b=box: b.read_file(path))
                timed(f"{kind} edit", lambda b=box: edited(SweEnv._edit(b, path, "- 1)", "- 2)")))
                timed(f"{kind} write", lambda b=box: b.write_file(path, content))  # the edit undone
        for box in boxes.values():
            assert box.read_file(path) == content
    finally:
        local.close()
        host.close()
    return times


def print_round_trips(times: dict[str, list[float]], calls: int) -> None:
    print(f"\nTool-call round trip, ms ({calls} calls each; pod, local and host calls alternate)")
    print(
        "| tool call | pod p50 | pod p90 | local p50 | local p90 | host p50 | pod / local p50 | pod / host p50 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, label in (
        ("true", "bash `true`"),
        ("read", "file read (`read_file`)"),
        ("write", "file write (`write_file`)"),
        ("edit", "edit (read + write)"),
    ):
        p, lo, h = times[f"pod {name}"], times[f"local {name}"], times[f"host {name}"]
        print(
            f"| {label} | {med(p)} | {ms(pct(p, 0.9))} | {med(lo)} | {ms(pct(lo, 0.9))} | {med(h)} "
            f"| {statistics.median(p) / statistics.median(lo):.1f}x "
            f"| {statistics.median(p) / statistics.median(h):.1f}x |"
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cold", type=int, default=5)
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument(
        "--workdir",
        default=os.environ.get("RLFLEET_DEV_CLUSTER_WORKDIR"),
        help="a running `scripts/dev-cluster up`'s directory (default: start one, stop it after)",
    )
    args = p.parse_args(argv)
    problem = bwrap_problem()
    if problem:
        print(f"the local baseline cannot run here: {problem}", file=sys.stderr)
        return 2
    problems = realnode.host_problems()
    if problems:
        print(f"this machine cannot run the real node: {'; '.join(problems)}", file=sys.stderr)
        return 2
    plane = None
    workdir = Path(args.workdir) if args.workdir else controlplane.scratch_dir("rlfleet-bench-sbx-")
    t = time.perf_counter()
    if args.workdir:
        kube, node = controlplane.KubeCluster.from_state(workdir), realnode.RealNode(workdir, log)
    else:
        plane = controlplane.ControlPlane(workdir, log=log, real_node=True)
        kube = plane.start()
        node = plane.node
    namespace = f"sbx-bench-{uuid.uuid4().hex[:6]}"
    try:
        image = nodeimages.sandbox_image(log=log)
        node.load_images([image])
        log(f"cluster ready in {time.perf_counter() - t:.0f} s")
        kube.kubectl("create", "namespace", namespace)
        uid = owner_pod(kube, namespace, "bench-trainer-0")
        config = SandboxPodConfig(
            namespace=namespace,
            job="bench",
            owner_pod="bench-trainer-0",
            owner_uid=uid,
            image=image.ref,
            image_pull_policy="Never",
            cpu="500m",
            memory="256Mi",
            node_selector={"rlfleet.dev/dev-node": "true"},
            max_seconds=1800,
        )
        version = kube.kubectl("version", "-o", "json").stdout
        server = json.loads(version).get("serverVersion", {}).get("gitVersion", "?")
        containerd = subprocess.run(
            ["containerd", "--version"], capture_output=True, text=True
        ).stdout.strip()
        print(
            f"{platform.node()}: {os.cpu_count()} CPUs, {platform.release()}, euid {os.geteuid()}, "
            f"Kubernetes {server}, {containerd}, load average before: {loadavg()}"
        )
        acquire_and_round_trip(kube, config, args)
        print(f"\nload average after: {loadavg()}")
    finally:
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        if plane is not None:
            try:
                plane.stop()
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
