"""Property tests of the pure builders and status functions over every valid group the catalog allows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st_

from rlfleet.api import KV_CACHE_DTYPES, WEIGHT_FORMATS, SamplerGroup
from rlfleet.catalog import CatalogError, check_group, load_catalog
from rlfleet.operator import builders
from rlfleet.operator import status as st

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
    spec = {"name": "g", "accelerator": cls, "weightFormat": fmt, "kvCacheDtype": kv, "replicas": replicas,
            "model": {"name": "m", "path": "/m"}, "suspend": suspend}  # fmt: skip
    if tp is not None:
        spec["tensorParallel"] = tp
    return {"apiVersion": "rlfleet.dev/v1alpha1", "kind": "SamplerGroup",
            "metadata": {"name": "job-g", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}  # fmt: skip


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
    manifest = sg_manifest(cls, fmt, kv, replicas, tp, suspend)
    sg = SamplerGroup.from_manifest(manifest)
    dep = builders.build_sampler_deployment(sg, "ns", manifest, CATALOG, None)
    pod = dep["spec"]["template"]["spec"]
    gpus = tp or CATALOG.get(cls).default_tensor_parallel
    # replicas: zero when suspended, else the spec's
    assert dep["spec"]["replicas"] == (0 if suspend else replicas)
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    assert engine["args"][engine["args"].index("--tp-size") + 1] == str(gpus)
    # placed only on the class's nodes
    values = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchExpressions"][0]["values"]
    assert values == CATALOG.get(cls).product_labels
    # precision flags: the KV flag iff not auto, a quantization flag iff not bf16
    assert ("--kv-cache-dtype" in engine["args"]) == (kv != "auto")
    assert ("--quantization" in engine["args"]) == (fmt != "bf16")
    # status: ready never exceeds what the Deployment reports, phase consistent with readiness
    observed = {"metadata": {"generation": 1}, "spec": {"replicas": dep["spec"]["replicas"]},
                "status": {"observedGeneration": 1, "replicas": min(ready, dep["spec"]["replicas"]),
                           "readyReplicas": min(ready, dep["spec"]["replicas"]),
                           "updatedReplicas": min(ready, dep["spec"]["replicas"])}}  # fmt: skip
    s = st.samplergroup_status(manifest, observed, CATALOG, now="2026-01-01T00:00:00Z")
    desired = dep["spec"]["replicas"]
    ready_n = min(ready, desired)
    assert s["ready"] == f"{ready_n}/{desired}"
    ready_cond = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert (ready_cond["status"] == "True") == (not suspend and ready_n >= desired)
    assert s["degradedPrecision"] == (CATALOG.get(cls).weight_formats[fmt].mode == "degraded")
    assert not st.status_changed(
        s, st.samplergroup_status(manifest | {"status": s}, observed, CATALOG, now="2026-02-01T00:00:00Z")
    )
