"""Operator reconcile latency against the real control plane (etcd + kube-apiserver + controllers + kwok).

    .venv/bin/python benchmarks/operator_reconcile.py [--repeats 3] [--jobs 20] [--attach WORKDIR]

1. The reference job (examples/rljob.yaml), `--repeats` times in fresh namespaces: time from `apply`
   to (a) every child object existing (ConfigMap, WeightChannel, trainer StatefulSet + Service, router
   Deployment + Service, 8 SamplerGroups, 8 sampler Deployments + Services), (b) every SamplerGroup
   Ready (pods scheduled onto kwok GPU nodes of their class, Running), (c) the RLJob phase Running.
2. `--jobs` copies of it applied at once in one namespace: per job, time to every child existing and to
   every SamplerGroup status being observed for the current generation (the fake cluster has 96 GPUs,
   so 20 x 16 sampler pods cannot all run: readiness is reported, not awaited).
Baseline (same process): one client server-side-applying the same child manifests directly, i.e. the
API cost with no operator; the ratio says how much the operator adds on top.
Prints p50/max and ratios; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import kopf
import yaml

from rlfleet.api import RLJob
from rlfleet.catalog import get_catalog
from rlfleet.operator import builders
from rlfleet.operator.kube import KubeApi, KubeError

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
API = "rlfleet.dev/v1alpha1"


def controlplane_module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "rlfleet_bench_controlplane", REPO / "tests" / "cluster" / "controlplane.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def kubectl(cluster: Any, *args: str, input: str | None = None) -> str:
    return cluster.kubectl(*args, input=input).stdout


def shared_volume(cluster: Any, namespace: str) -> None:
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"weights-{namespace}"},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "hostPath": {"path": f"/tmp/rlfleet-weights-{namespace}"},
            "claimRef": {"namespace": namespace, "name": "rlfleet-weights"},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "rlfleet-weights", "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": f"weights-{namespace}",
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    kubectl(
        cluster,
        "apply",
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}),
    )


def start_operator(cluster: Any, namespace: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(Path(sys.executable).parent / "rlfleet"),
            "operator",
            "run",
            "--namespace",
            namespace,
            "--kubeconfig",
            str(cluster.kubeconfig),
            "--standalone",
        ],
        env=cluster.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


async def children_exist(api: KubeApi, namespace: str, job: str, groups: list[str]) -> bool:
    needed = [
        ("v1", "ConfigMap", f"{job}-config"),
        (API, "WeightChannel", f"{job}-weights"),
        ("v1", "Service", f"{job}-trainer"),
        ("apps/v1", "StatefulSet", f"{job}-trainer"),
        ("v1", "Service", f"{job}-router"),
        ("apps/v1", "Deployment", f"{job}-router"),
    ]
    for g in groups:
        needed += [
            (API, "SamplerGroup", f"{job}-{g}"),
            ("apps/v1", "Deployment", f"{job}-{g}"),
            ("v1", "Service", f"{job}-{g}"),
        ]
    found = await asyncio.gather(*(api.get(v, k, namespace, n) for v, k, n in needed))
    return all(found)


async def group_states(api: KubeApi, namespace: str, job: str, groups: list[str]) -> list[dict]:
    found = await asyncio.gather(*(api.get(API, "SamplerGroup", namespace, f"{job}-{g}") for g in groups))
    sgs = [sg for sg in found if sg is not None]
    return [
        {
            "observed": (sg.get("status") or {}).get("observedGeneration") == sg["metadata"]["generation"],
            "ready": (sg.get("status") or {}).get("phase") == "Running",
        }
        for sg in sgs
    ]


async def one_job(api: KubeApi, cluster: Any, namespace: str) -> dict[str, float]:
    groups = [g["name"] for g in EXAMPLE["spec"]["samplerGroups"]]
    job = EXAMPLE["metadata"]["name"]
    t0 = time.perf_counter()
    kubectl(cluster, "apply", "-n", namespace, "-f", str(REPO / "examples" / "rljob.yaml"))
    marks: dict[str, float] = {}
    while time.perf_counter() - t0 < 180:
        if "children" not in marks and await children_exist(api, namespace, job, groups):
            marks["children"] = time.perf_counter() - t0
        if "children" in marks and "groups_ready" not in marks:
            states = await group_states(api, namespace, job, groups)
            if len(states) == len(groups) and all(s["ready"] and s["observed"] for s in states):
                marks["groups_ready"] = time.perf_counter() - t0
        if "groups_ready" in marks:
            body = await api.get(API, "RLJob", namespace, job)
            if (body.get("status") or {}).get("phase") == "Running":
                marks["job_running"] = time.perf_counter() - t0
                return marks
        await asyncio.sleep(0.1)
    raise RuntimeError(f"job did not converge in 180 s: {marks}")


async def many_jobs(api: KubeApi, cluster: Any, namespace: str, count: int) -> dict[str, Any]:
    groups = [g["name"] for g in EXAMPLE["spec"]["samplerGroups"]]
    names = [f"job-{i:02d}" for i in range(count)]
    docs = []
    for name in names:
        m = copy.deepcopy(EXAMPLE)
        m["metadata"]["name"] = name
        docs.append(m)
    t0 = time.perf_counter()
    kubectl(
        cluster,
        "apply",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
    )
    children: dict[str, float] = {}
    observed: dict[str, float] = {}
    ready_groups = 0
    while time.perf_counter() - t0 < 300 and len(observed) < count:
        for name in names:
            if name not in children and await children_exist(api, namespace, name, groups):
                children[name] = time.perf_counter() - t0
            if name in children and name not in observed:
                states = await group_states(api, namespace, name, groups)
                if len(states) == len(groups) and all(s["observed"] for s in states):
                    observed[name] = time.perf_counter() - t0
        await asyncio.sleep(0.2)
    for name in names:
        ready_groups += sum(s["ready"] for s in await group_states(api, namespace, name, groups))
    return {
        "children": list(children.values()),
        "observed": list(observed.values()),
        "ready_groups": ready_groups,
        "total": max(observed.values()) if len(observed) == count else float("nan"),
    }


async def direct_apply_baseline(api: KubeApi, namespace: str) -> float:
    """One client applying the same manifests the operator writes (RLJob children + SG children)."""
    job = RLJob.from_manifest(EXAMPLE)
    owner = None
    manifests = builders.build_job_children(job, namespace, owner, get_catalog())
    from rlfleet.api import SamplerGroup, StoreSpec

    store = StoreSpec.model_validate(EXAMPLE["spec"]["weightChannel"]["store"])
    for m in list(manifests):
        if m["kind"] == "SamplerGroup":
            sg = SamplerGroup.from_manifest(m)
            manifests += builders.build_samplergroup_children(sg, namespace, None, get_catalog(), store)
    t0 = time.perf_counter()
    for m in manifests:
        await api.apply(m)
    return time.perf_counter() - t0


def summary(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"p50 {statistics.median(values):6.2f} s   max {max(values):6.2f} s   (n={len(values)})"


async def run(cluster: Any, repeats: int, jobs: int) -> None:
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    api = KubeApi(
        kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    )  # what the operator logs in with
    try:
        kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
        for crd in ("rljobs", "samplergroups", "weightchannels"):
            kubectl(cluster, "wait", "--for=condition=Established", f"crd/{crd}.rlfleet.dev", "--timeout=60s")
        base_ns = f"bench-base-{uuid.uuid4().hex[:6]}"
        kubectl(cluster, "create", "namespace", base_ns)
        baseline = await direct_apply_baseline(api, base_ns)
        kubectl(cluster, "delete", "namespace", base_ns, "--wait=false")
        print(f"baseline: one client applying the same {6 + 8 + 16} manifests directly: {baseline:.2f} s")

        results: dict[str, list[float]] = {"children": [], "groups_ready": [], "job_running": []}
        for i in range(repeats):
            ns = f"bench-{i}-{uuid.uuid4().hex[:6]}"
            kubectl(cluster, "create", "namespace", ns)
            kubectl(cluster, "wait", "--for=create", "serviceaccount/default", "-n", ns, "--timeout=30s")
            shared_volume(cluster, ns)
            proc = start_operator(cluster, ns)
            try:
                time.sleep(2.0)  # operator start-up is not part of the reconcile latency
                marks = await one_job(api, cluster, ns)
            finally:
                stop(proc)
                kubectl(cluster, "delete", "namespace", ns, "--wait=false")
            for key, value in marks.items():
                results[key].append(value)
            print(f"  run {i}: " + ", ".join(f"{k} {v:.2f} s" for k, v in marks.items()))
        print("reference job (8 groups x 2 replicas + trainer + router):")
        for key, values in results.items():
            print(f"  {key:<13} {summary(values)}")
        print(
            f"  ratio children / direct-apply baseline: {statistics.median(results['children']) / baseline:.2f}x"
        )

        if jobs:
            ns = f"bench-many-{uuid.uuid4().hex[:6]}"
            kubectl(cluster, "create", "namespace", ns)
            kubectl(cluster, "wait", "--for=create", "serviceaccount/default", "-n", ns, "--timeout=30s")
            shared_volume(cluster, ns)
            proc = start_operator(cluster, ns)
            try:
                time.sleep(2.0)
                many = await many_jobs(api, cluster, ns, jobs)
            finally:
                stop(proc)
                kubectl(cluster, "delete", "namespace", ns, "--wait=false")
            print(f"{jobs} jobs x 8 groups applied at once:")
            print(f"  children      {summary(many['children'])}")
            print(f"  reconciled    {summary(many['observed'])}   (every SamplerGroup status observed)")
            print(
                f"  all {jobs} reconciled after {many['total']:.2f} s; {many['ready_groups']}/{jobs * 8} groups Ready "
                f"(96 fake GPUs)"
            )
            print(
                f"  ratio total / ({jobs} x direct-apply baseline): {many['total'] / (jobs * baseline):.2f}x"
            )
    except KubeError as exc:
        raise SystemExit(f"benchmark failed: {exc}") from None
    finally:
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument(
        "--attach",
        help="workdir of a running `controlplane.py up` (default: $RLFLEET_KUBE_WORKDIR or start one)",
    )
    args = parser.parse_args()
    cp = controlplane_module()
    attach = args.attach or os.environ.get("RLFLEET_KUBE_WORKDIR")
    if attach:
        asyncio.run(run(cp.KubeCluster.from_state(Path(attach)), args.repeats, args.jobs))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="rlfleet-bench-kube-"))
    plane = cp.ControlPlane(workdir)
    try:
        cluster = plane.start()
        print(f"control plane up in {cluster.start_seconds:.1f} s")
        asyncio.run(run(cluster, args.repeats, args.jobs))
    finally:
        plane.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
