"""Property tests of the pure builders and status functions over every valid group the catalog allows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st_

from rlfleet.api import KV_CACHE_DTYPES, WEIGHT_FORMATS, SamplerGroup
from rlfleet.catalog import CatalogError, check_group, load_catalog
from rlfleet.operator import status as st
from rlfleet.operator import workloads
from rlfleet.operator.group_status import samplergroup_status

CATALOG = load_catalog(None)


def _valid_combos() -> list[tuple[str, str, str]]:
    out = []
    for c in CATALOG.names():
        for f in WEIGHT_FORMATS:
            for k in KV_CACHE_DTYPES:
                try:
                    check_group(c, f, k, catalog=CATALOG)
                    out.append((c, f, k))
                except CatalogError:
                    pass
    return out


COMBOS = _valid_combos()


def sg_manifest(cls: str, fmt: str, kv: str, replicas: int, tp: int | None, suspend: bool) -> dict:
    spec = {
        "name": "g",
        "accelerator": cls,
        "weightFormat": fmt,
        "kvCacheDtype": kv,
        "replicas": replicas,
        "model": {"name": "m", "path": "/m"},
        "suspend": suspend,
    }
    if tp is not None:
        spec["tensorParallel"] = tp
    return {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": "SamplerGroup",
        "metadata": {"name": "job-g", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": spec,
    }


@settings(max_examples=150, deadline=None)
@given(
    combo=st_.sampled_from(COMBOS),
    replicas=st_.integers(0, 16),
    tp=st_.one_of(st_.none(), st_.integers(1, 8)),
    suspend=st_.booleans(),
    ready=st_.integers(0, 16),
)
def test_sampler_deployment_invariants(combo, replicas, tp, suspend, ready) -> None:
    cls, fmt, kv = combo
    on_gpu = CATALOG.get(cls).gpu
    if not on_gpu:
        tp = tp if tp in (None, 1) else None  # a CPU class runs one process per replica (refused otherwise)
    manifest = sg_manifest(cls, fmt, kv, replicas, tp, suspend)
    sg = SamplerGroup.from_manifest(manifest)
    dep = workloads.build_sampler_deployment(sg, "ns", manifest, CATALOG, None)
    pod = dep["spec"]["template"]["spec"]
    gpus = tp or CATALOG.get(cls).default_tensor_parallel
    # replicas: zero when suspended, else the spec's
    assert dep["spec"]["replicas"] == (0 if suspend else replicas)
    engine = pod["containers"][0]
    # precision flags: the KV flag iff not auto
    assert ("--kv-cache-dtype" in engine["args"]) == (kv != "auto")
    if not on_gpu:  # the reference engine: no GPU anywhere in the pod, the class's CPU/memory requests
        assert "nvidia.com/gpu" not in str(pod) and "affinity" not in pod and "tolerations" not in pod
        assert engine["name"] == "reference" and engine["command"] == ["rlfleet"]
        assert engine["resources"] == CATALOG.get(cls).sampler_resources
        assert engine["args"][engine["args"].index("--weight-format") + 1] == fmt
    else:
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        assert engine["args"][engine["args"].index("--tp-size") + 1] == str(gpus)
        # placed only on the class's nodes
        values = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"
        ][0]["matchExpressions"][0]["values"]
        assert values == CATALOG.get(cls).product_labels
        # a quantization flag iff not bf16
        assert ("--quantization" in engine["args"]) == (fmt != "bf16")
    # status: ready never exceeds what the Deployment reports, phase consistent with readiness
    observed = {
        "metadata": {"generation": 1},
        "spec": {"replicas": dep["spec"]["replicas"]},
        "status": {
            "observedGeneration": 1,
            "replicas": min(ready, dep["spec"]["replicas"]),
            "readyReplicas": min(ready, dep["spec"]["replicas"]),
            "updatedReplicas": min(ready, dep["spec"]["replicas"]),
        },
    }
    s = samplergroup_status(manifest, observed, CATALOG, now="2026-01-01T00:00:00Z")
    desired = dep["spec"]["replicas"]
    ready_n = min(ready, desired)
    assert s["ready"] == f"{ready_n}/{desired}"
    ready_cond = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert (ready_cond["status"] == "True") == (not suspend and ready_n >= desired)
    assert s["degradedPrecision"] == (CATALOG.get(cls).weight_formats[fmt].mode == "degraded")
    assert not st.status_changed(
        s, samplergroup_status(manifest | {"status": s}, observed, CATALOG, now="2026-02-01T00:00:00Z")
    )


def _mounted(container: dict, path: str) -> str | None:
    """Name of the volume under which `path` is visible in `container` (None: not mounted)."""
    for mount in container.get("volumeMounts", []):
        root = mount["mountPath"].rstrip("/")
        if path == root or path.startswith(root + "/"):
            return mount["name"]
    return None


@settings(max_examples=40, deadline=None)
@given(combo=st_.sampled_from(COMBOS), suspend=st_.booleans())
def test_sampler_pod_shares_one_weights_cache_and_has_no_api_token(combo, suspend) -> None:
    """Every path under the weights cache a container of the pod uses (the engine's launch file and model
    directory, the sidecar's --cache-dir, the init container's fetch) is on a mount of the SAME emptyDir
    volume: the sidecar verifies into it and SGLang reads from it. And the pod gets no service-account
    token (samplers need no API rights: the sidecar reports through the store)."""
    from rlfleet.api import StoreSpec
    from rlfleet.operator import naming as n

    manifest = sg_manifest(*combo, replicas=1, tp=None, suspend=suspend)
    manifest["spec"]["weightChannel"] = "job-weights"
    sg = SamplerGroup.from_manifest(manifest)
    store = StoreSpec(type="filesystem", path="/weights/job", volume_claim_name="weights")
    pod = workloads.build_sampler_deployment(sg, "ns", manifest, CATALOG, store)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    containers = pod["containers"] + pod.get("initContainers", [])
    used = 0
    for container in containers:
        words = [*container.get("command", []), *container.get("args", [])]
        paths = {p for w in words for p in w.split() if p.startswith(n.WEIGHTS_CACHE)}
        for path in paths:
            volume = _mounted(container, path)
            assert volume is not None, (container["name"], path)
            assert "emptyDir" in volumes[volume], (container["name"], volume)
            used += 1
    cache_volumes = {_mounted(c, n.WEIGHTS_CACHE) for c in containers}
    assert len(cache_volumes) == 1 and None not in cache_volumes  # one cache, mounted in every container
    assert used >= 2  # the engine and the sidecar both really use it


def test_trainer_pods_have_no_api_token() -> None:
    from pathlib import Path

    from rlfleet.api import load_rljob

    job = load_rljob(Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml")
    sts = workloads.build_trainer_statefulset(job, "ns", None, CATALOG)
    assert sts["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
