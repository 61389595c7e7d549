"""Argo CD health checks (charts/rlfleet/argocd/*.lua) run in a Lua 5.1 interpreter, as Argo CD's
gopher-lua does, against sample live objects; plus the argocd-cm snippet and the example Application."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

lua51 = pytest.importorskip("lupa.lua51")

REPO = Path(__file__).resolve().parents[2]
ARGOCD = REPO / "charts" / "rlfleet" / "argocd"
KINDS = ("RLJob", "SamplerGroup", "WeightChannel")
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def _to_lua(runtime: Any, value: Any) -> Any:
    """Python JSON value -> Lua value the way Argo CD hands `obj` to gopher-lua (arrays 1-based)."""
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def health(kind: str, obj: dict[str, Any]) -> dict[str, str]:
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    assert runtime.eval("_VERSION") == "Lua 5.1"
    runtime.globals().obj = _to_lua(runtime, obj)
    result = runtime.execute((ARGOCD / f"{kind.lower()}.lua").read_text())
    return dict(result.items())


def cond(kind: str, status: str, message: str = "", generation: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind, "status": status, "reason": "Test", "message": message}
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def obj_of(kind: str, generation: int = 3, status: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "apiVersion": "rlfleet.dev/v1alpha1",
        "kind": kind,
        "metadata": {"name": "demo", "namespace": "ml", "generation": generation},
        "spec": {},
    }
    if status is not None:
        out["status"] = status
    return out


READY = [cond("Ready", "True", "all groups ready"), cond("CollapseRisk", "False")]

CASES = [
    # (kind, status, expected health, substring of the message)
    *[(k, None, "Progressing", "Waiting for the rlfleet operator") for k in KINDS],
    *[(k, {"observedGeneration": 3, "conditions": READY}, "Healthy", "") for k in KINDS],
    *[(k, {"observedGeneration": 2, "conditions": READY}, "Progressing", "generation 3") for k in KINDS],
    *[(k, {"conditions": READY}, "Progressing", "generation 3") for k in KINDS],
    *[
        (
            k,
            {"observedGeneration": 3, "conditions": [cond("Ready", "False", "2/8 groups ready")]},
            "Progressing",
            "2/8 groups ready",
        )
        for k in KINDS
    ],
    *[(k, {"observedGeneration": 3}, "Progressing", "") for k in KINDS],
    *[
        (
            k,
            {
                "observedGeneration": 3,
                "conditions": [*READY[:1], cond("CollapseRisk", "True", "OOR share 0.4 > 0.2")],
            },
            "Degraded",
            "OOR share 0.4",
        )
        for k in KINDS
    ],
    # collapse risk wins even while a new generation is being rolled out
    *[
        (
            k,
            {"observedGeneration": 1, "conditions": [cond("CollapseRisk", "True", "KL rising")]},
            "Degraded",
            "CollapseRisk: KL rising",
        )
        for k in KINDS
    ],
    *[
        (
            k,
            {
                "observedGeneration": 3,
                "phase": "Failed",
                "conditions": [cond("Ready", "False", "trainer crashed")],
            },
            "Degraded",
            "trainer crashed",
        )
        for k in KINDS
    ],
    (
        "RLJob",
        {
            "observedGeneration": 3,
            "phase": "Suspended",
            "message": "suspended by spec",
            "conditions": [cond("Ready", "False")],
        },
        "Suspended",
        "suspended by spec",
    ),
    (
        "RLJob",
        {"observedGeneration": 3, "phase": "Succeeded", "conditions": [cond("Ready", "False")]},
        "Healthy",
        "Succeeded",
    ),
    ("RLJob", {"observedGeneration": 2, "phase": "Succeeded"}, "Progressing", "generation 3"),
    (
        "RLJob",
        {
            "observedGeneration": 3,
            "phase": "Degraded",
            "conditions": [cond("Ready", "False", "h100-fp8 1/2")],
        },
        "Degraded",
        "h100-fp8 1/2",
    ),
    # blocked: the operator's Degraded condition (a quota, a missing PVC, the channel's store) is Argo's Degraded
    (
        "RLJob",
        {
            "observedGeneration": 3,
            "phase": "Degraded",
            "reason": "ReplicaFailure",
            "conditions": [
                cond("Ready", "False", "trainer"),
                {
                    **cond("Degraded", "True", "0/1 pods created: exceeded quota: compute"),
                    "reason": "ReplicaFailure",
                },
            ],
        },
        "Degraded",
        "ReplicaFailure: 0/1 pods",
    ),
    (
        "RLJob",
        {"observedGeneration": 2, "phase": "Degraded", "conditions": [cond("Degraded", "True", "old spec")]},
        "Progressing",
        "generation 3",
    ),
    (
        "SamplerGroup",
        {"observedGeneration": 3, "phase": "Suspended", "conditions": [cond("Ready", "False")]},
        "Suspended",
        "Suspended",
    ),
    (
        "SamplerGroup",
        {"observedGeneration": 3, "phase": "Running", "ready": "2/2", "conditions": READY},
        "Healthy",
        "Ready 2/2",
    ),
    (
        "SamplerGroup",
        {
            "observedGeneration": 3,
            "phase": "Degraded",
            "ready": "1/2",
            "conditions": [cond("Ready", "False", "1/2 replicas ready")],
        },
        "Degraded",
        "1/2 replicas",
    ),
    (
        "SamplerGroup",
        {
            "observedGeneration": 3,
            "phase": "Quarantined",
            "quarantined": True,
            "message": "OOR share 3x token share",
            "conditions": READY,
        },
        "Degraded",
        "Quarantined: OOR share",
    ),
    (
        "SamplerGroup",
        {"observedGeneration": 3, "quarantined": False, "degradedPrecision": True, "conditions": READY},
        "Healthy",
        "",
    ),
    (
        "WeightChannel",
        {"observedGeneration": 3, "phase": "Ready", "latestVersion": 17, "conditions": READY},
        "Healthy",
        "Latest version 17",
    ),
    (
        "WeightChannel",
        {
            "observedGeneration": 3,
            "phase": "Degraded",
            "message": "sha256 mismatch in fp8 view",
            "conditions": [cond("Ready", "False")],
        },
        "Degraded",
        "sha256 mismatch",
    ),
    (
        "WeightChannel",
        {"observedGeneration": 3, "phase": "Pending", "conditions": [cond("Ready", "False")]},
        "Progressing",
        "No version published yet",
    ),
    (
        "WeightChannel",
        {
            "observedGeneration": 3,
            "phase": "Pending",
            "conditions": [
                cond("Ready", "False"),
                {
                    **cond("Degraded", "True", "store s3://ckpt/run1 unreachable from the operator"),
                    "reason": "StoreUnreachable",
                },
            ],
        },
        "Degraded",
        "StoreUnreachable: store s3://ckpt",
    ),
]


@pytest.mark.parametrize(("kind", "status", "expected", "message"), CASES)
def test_health_of_sample_objects(
    kind: str, status: dict[str, Any] | None, expected: str, message: str
) -> None:
    hs = health(kind, obj_of(kind, status=copy.deepcopy(status)))
    assert hs["status"] == expected, hs
    assert message in hs["message"], hs
    assert isinstance(hs["message"], str) and hs["message"]


condition_st = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["Ready", "Progressing", "Degraded", "CollapseRisk"]),
        "status": st.sampled_from(["True", "False", "Unknown"]),
        "message": st.text(max_size=20),
    }
)
status_st = st.none() | st.fixed_dictionaries(
    {},
    optional={
        "observedGeneration": st.integers(0, 5),
        "phase": st.sampled_from(
            ["Pending", "Running", "Ready", "Degraded", "Suspended", "Quarantined", "Failed", "Succeeded"]
        ),
        "conditions": st.lists(condition_st, max_size=4, unique_by=lambda c: c["type"]),
        "message": st.text(max_size=20),
        "quarantined": st.booleans(),
        "ready": st.sampled_from(["0/1", "1/1"]),
        "latestVersion": st.integers(0, 100),
    },
)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(KINDS), generation=st.integers(1, 5), status=status_st)
def test_healthy_only_when_current_and_ready(
    kind: str, generation: int, status: dict[str, Any] | None
) -> None:
    hs = health(kind, obj_of(kind, generation=generation, status=status))
    assert hs["status"] in ARGO_STATUSES
    conditions = {c["type"]: c["status"] for c in (status or {}).get("conditions", [])}
    if hs["status"] == "Healthy":
        assert status is not None and status.get("observedGeneration") == generation
        assert conditions.get("Ready") == "True" or (kind == "RLJob" and status.get("phase") == "Succeeded")
        assert conditions.get("CollapseRisk") != "True"
        assert status.get("phase") != "Failed"
    if conditions.get("CollapseRisk") == "True" or (status or {}).get("phase") == "Failed":
        assert hs["status"] == "Degraded"
    # a blocked object of the current generation is Degraded, unless suspended (or, a job, finished)
    exempt = {"RLJob": ("Suspended", "Succeeded"), "SamplerGroup": ("Suspended",), "WeightChannel": ()}[kind]
    if (
        status is not None
        and status.get("observedGeneration") == generation
        and (conditions.get("Degraded") == "True" or status.get("phase") == "Degraded")
        and status.get("phase") not in exempt
    ):
        assert hs["status"] == "Degraded"


def test_argocd_cm_snippet_embeds_the_lua_files_verbatim() -> None:
    cm = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["name"] == "argocd-cm"
    expected = {
        f"resource.customizations.health.rlfleet.dev_{k}": (ARGOCD / f"{k.lower()}.lua").read_text()
        for k in KINDS
    }
    assert cm["data"] == expected


def test_example_applications_sync_crds_first_with_server_side_apply() -> None:
    apps = [d for d in yaml.safe_load_all((REPO / "examples" / "argocd-application.yaml").read_text()) if d]
    assert all(a["apiVersion"] == "argoproj.io/v1alpha1" and a["kind"] == "Application" for a in apps)
    by_path = {a["spec"]["source"]["path"]: a for a in apps}
    assert set(by_path) == {"charts/rlfleet/crds", "charts/rlfleet", "examples"}
    wave = {p: int(a["metadata"]["annotations"]["argocd.argoproj.io/sync-wave"]) for p, a in by_path.items()}
    assert wave["charts/rlfleet/crds"] < wave["charts/rlfleet"] < wave["examples"]
    for app in apps:
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"]
    # the CRs may be dry-run before their CRD exists; the CRDs are never pruned from Git
    assert "SkipDryRunOnMissingResource=true" in by_path["examples"]["spec"]["syncPolicy"]["syncOptions"]
    assert by_path["charts/rlfleet/crds"]["spec"]["syncPolicy"]["automated"]["prune"] is False
    assert by_path["charts/rlfleet"]["spec"]["source"]["helm"]["skipCrds"] is True
    assert (REPO / "examples" / by_path["examples"]["spec"]["source"]["directory"]["include"]).is_file()
    for path in by_path:
        assert (REPO / path).is_dir()


def test_chart_objects_that_need_a_crd_of_the_same_sync_skip_the_dry_run() -> None:
    template = (REPO / "charts" / "rlfleet" / "templates" / "peering.yaml").read_text()
    assert template.count("argocd.argoproj.io/sync-options: SkipDryRunOnMissingResource=true") == 2
