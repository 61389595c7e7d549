"""The Helm chart rendered by a real helm (no cluster): objects, RBAC modes, security, catalog
override, schema validation, CRD copies, monitoring (rules and dashboard parse as PromQL and name
only metrics the code exports)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.control_plane import role_grants
from support.example_children import example_workloads

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlfleet"


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def operator_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find(objs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- chart files ------------------------------------------------------------------------------------


def test_chart_crds_are_exact_copies_of_the_generated_crds() -> None:
    generated = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert generated, "crds/*.yaml missing (rlfleet crds)"
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (REPO / "crds" / name).read_bytes(), (
            f"charts/rlfleet/crds/{name} differs from crds/{name}: run `rlfleet crds` (it writes both)"
        )
    extra = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert set(extra) - set(generated) == {"kopf.dev_peerings.yaml"}


def test_kopf_peering_crds_match_what_kopf_watches() -> None:
    from kopf._cogs.structs import references

    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text()))
    served = {(c["spec"]["group"], c["spec"]["names"]["plural"], c["spec"]["scope"]) for c in crds}
    cluster, namespaced = references.CLUSTER_PEERINGS_K, references.NAMESPACED_PEERINGS_K
    assert (cluster.group, cluster.version) == (namespaced.group, namespaced.version) == ("kopf.dev", "v1")
    assert {
        (cluster.group, cluster.any_name, "Cluster"),
        (namespaced.group, namespaced.any_name, "Namespaced"),
    } == served
    assert {c["spec"]["versions"][0]["name"] for c in crds} == {cluster.version}
    for crd in crds:  # kopf keeps its keep-alives in .status (no status subresource): it must be preserved
        status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True
        assert "subresources" not in crd["spec"]["versions"][0]


def test_helm_lint_passes(helm) -> None:
    out = helm("lint", str(CHART), "--strict", "--kube-version", "v1.36.3")
    assert "0 chart(s) failed" in out


# --- default render -----------------------------------------------------------------------------------


def test_default_render_has_the_operator_objects(render) -> None:
    objs = render()
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ConfigMap",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
            "ClusterKopfPeering",
            # the admission webhook (on by default): its Service, configuration, and the operator's grants for its
            # certificate (a Role for the Secret, a ClusterRole for the configuration's caBundle)
            "Service",
            "ValidatingWebhookConfiguration",
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
            # the sandbox roles the operator binds trainers to (sandbox pods, agent-sandbox), never bound to the
            # operator itself
            "ClusterRole",
            "ClusterRole",
        ]
    )
    for obj in objs:
        if obj["kind"] not in (
            "ClusterRole",
            "ClusterRoleBinding",
            "ClusterKopfPeering",
            "ValidatingWebhookConfiguration",
        ):
            assert obj["metadata"]["namespace"] == "rlfleet-system", obj["kind"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rlfleet"


def test_operator_pod_is_non_root_read_only_and_probed(render) -> None:
    objs = render()
    (deployment,) = find(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    container = operator_container(objs)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    assert container["image"] == "ghcr.io/rlfleet/operator:0.1.0"  # appVersion
    assert pod["serviceAccountName"] == find(objs, "ServiceAccount")[0]["metadata"]["name"]


def test_image_digest_pins_the_image(render) -> None:
    digest = "sha256:" + "ab" * 32
    assert (
        operator_container(render({"image": {"digest": digest}}))["image"]
        == f"ghcr.io/rlfleet/operator@{digest}"
    )


def test_ha_peering_gives_each_pod_an_identity_and_a_distinct_priority(render) -> None:
    objs = render()
    (deployment,) = find(objs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    container = operator_container(objs)
    assert "--peering=rlfleet" in container["args"]
    assert "--priority=auto" in container["args"]  # same priorities would freeze every replica (kopf)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    (peering,) = find(objs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "rlfleet"
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_standalone_mode_has_no_peering_and_refuses_two_replicas(render, helm) -> None:
    objs = render({"operator": {"replicas": 1, "peering": {"enabled": False, "name": "rlfleet"}}})
    assert not find(objs, "ClusterKopfPeering")
    assert "--standalone" in operator_container(objs)["args"]
    (clusterrole,) = find(objs, "ClusterRole", "rlfleet")
    assert not any(r[0] == "kopf.dev" for r in role_grants(clusterrole))
    with pytest.raises(Exception, match="peering"):
        render({"operator": {"replicas": 2, "peering": {"enabled": False, "name": "rlfleet"}}})


# --- RBAC ---------------------------------------------------------------------------------------------

NAMESPACED_RULES = {
    *{("rlfleet.dev", "rljobs", v) for v in ("list", "watch", "patch")},
    *{("rlfleet.dev", "samplergroups", v) for v in ("list", "watch", "create", "patch", "delete")},
    *{("rlfleet.dev", "weightchannels", v) for v in ("get", "list", "watch", "create", "patch")},
    *{("rlfleet.dev", f"{r}/status", "patch") for r in ("rljobs", "samplergroups", "weightchannels")},
    ("rlfleet.dev", "samplergroups/scale", "patch"),  # the fleet-mix optimizer's replicas (router.optimize)
    *{("apps", r, v) for r in ("deployments", "statefulsets") for v in ("list", "watch", "create", "patch")},
    *{("", r, v) for r in ("services", "configmaps") for v in ("create", "patch")},
    ("", "events", "create"),
    (
        "",
        "events",
        "list",
    ),  # the kubelet's FailedMount Events, watched into an index (missing volume Secrets)
    ("", "events", "watch"),
    ("", "secrets", "create"),  # the router's admin token and the engine API key, created once per job
    ("", "secrets", "get"),  # ... and read back by name by the rebalancer (never listed or watched)
    ("", "pods", "list"),  # the operator's pods, watched into an index (status reasons, scrape targets)
    ("", "pods", "watch"),
    ("networking.k8s.io", "networkpolicies", "create"),  # the jobs' NetworkPolicies, server-side applied
    ("networking.k8s.io", "networkpolicies", "patch"),
    # sandbox pods (operator/sandboxes.py): the trainer's ServiceAccount and its RoleBinding
    *{
        (g, r, v)
        for g, r in (("", "serviceaccounts"), ("rbac.authorization.k8s.io", "rolebindings"))
        for v in ("create", "patch")
    },
}
SANDBOX_RULES = {("", "pods", v) for v in ("create", "delete", "get", "list")} | {
    ("", "pods/exec", v) for v in ("create", "get")
}
AGENT_SANDBOX_RULES = {
    ("extensions.agents.x-k8s.io", "sandboxclaims", v) for v in ("create", "delete", "list", "watch")
} | {
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "create"),
    ("extensions.agents.x-k8s.io", "sandboxwarmpools", "get"),
    ("extensions.agents.x-k8s.io", "sandboxwarmpools/scale", "patch"),
    ("agents.x-k8s.io", "sandboxes", "get"),
}


def test_cluster_mode_rbac_is_exactly_the_operators_calls(render) -> None:
    objs = render()
    (role,) = find(objs, "ClusterRole", "rlfleet")
    expected = NAMESPACED_RULES | {
        *{("kopf.dev", "clusterkopfpeerings", v) for v in ("list", "watch", "patch")},
        ("rbac.authorization.k8s.io", "clusterroles", "bind"),
    }  # no CRD access: the operator disables kopf's CRD scanning (its kinds are fixed)
    assert role_grants(role) == expected
    # `bind` of the sandbox role alone: the operator grants a trainer its rights without holding them
    (bind,) = [r for r in role["rules"] if "bind" in r["verbs"]]
    assert bind["resourceNames"] == [
        "rlfleet-rlfleet-system-sandboxes",
        "rlfleet-rlfleet-system-agent-sandboxes",
    ]
    (sandbox_role,) = find(objs, "ClusterRole", "rlfleet-rlfleet-system-sandboxes")
    assert role_grants(sandbox_role) == SANDBOX_RULES
    (agent_role,) = find(objs, "ClusterRole", "rlfleet-rlfleet-system-agent-sandboxes")
    assert role_grants(agent_role) == AGENT_SANDBOX_RULES
    env = {e["name"]: e.get("value") for e in operator_container(objs)["env"]}
    assert env["RLFLEET_SANDBOX_ROLE"] == "ClusterRole/rlfleet-rlfleet-system-sandboxes"
    assert env["RLFLEET_AGENT_SANDBOX_ROLE"] == "ClusterRole/rlfleet-rlfleet-system-agent-sandboxes"
    assert not any("*" in (g, r, v) for g, r, v in role_grants(role))
    assert not any(r in ("pods/exec", "nodes/proxy") for _, r, _ in role_grants(role))
    assert {v for _, r, v in role_grants(role) if r == "secrets"} == {
        "create",
        "get",
    }  # never list/watch Secrets
    (binding,) = find(objs, "ClusterRoleBinding", "rlfleet")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": find(objs, "ServiceAccount")[0]["metadata"]["name"],
            "namespace": "rlfleet-system",
        }
    ]
    assert "--all-namespaces" in operator_container(objs)["args"]


def test_namespace_mode_has_no_cluster_wide_permission(render) -> None:
    without_webhook = render(
        {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "webhook": {"enabled": False}},
        namespace="ops",
    )
    assert not [o for o in without_webhook if o["kind"].startswith("Cluster")]
    objs = render({"operator": {"watchNamespaces": ["team-a", "team-b"]}}, namespace="ops")
    assert not find(objs, "ClusterKopfPeering")
    # with the webhook (default) the one cluster-scoped grant: get/patch of its own configuration, by name
    (clusterrole,) = find(objs, "ClusterRole")
    assert clusterrole["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"],
            "resourceNames": ["rlfleet-ops"],
            "verbs": ["get", "patch"],
        }
    ]
    (configuration,) = find(objs, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["name"] == "rlfleet-ops"
    roles = find(objs, "Role", "rlfleet")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert role_grants(role) == NAMESPACED_RULES | {
            ("kopf.dev", "kopfpeerings", v) for v in ("list", "watch", "patch")
        } | {("rbac.authorization.k8s.io", "roles", "bind")}
        (bind,) = [r for r in role["rules"] if "bind" in r["verbs"]]
        assert bind["resourceNames"] == ["rlfleet-sandboxes", "rlfleet-agent-sandboxes"]
    sandbox_roles = find(objs, "Role", "rlfleet-sandboxes")  # the sandbox roles, Roles in each namespace
    assert sorted(r["metadata"]["namespace"] for r in sandbox_roles) == ["team-a", "team-b"]
    assert all(role_grants(r) == SANDBOX_RULES for r in sandbox_roles)
    agent_roles = find(objs, "Role", "rlfleet-agent-sandboxes")
    assert sorted(r["metadata"]["namespace"] for r in agent_roles) == ["team-a", "team-b"]
    assert all(role_grants(r) == AGENT_SANDBOX_RULES for r in agent_roles)
    env = {e["name"]: e.get("value") for e in operator_container(objs)["env"]}
    assert env["RLFLEET_SANDBOX_ROLE"] == "Role/rlfleet-sandboxes"
    assert env["RLFLEET_AGENT_SANDBOX_ROLE"] == "Role/rlfleet-agent-sandboxes"
    bindings = find(objs, "RoleBinding", "rlfleet")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert all(b["subjects"][0]["namespace"] == "ops" for b in bindings)
    assert sorted(p["metadata"]["namespace"] for p in find(objs, "KopfPeering")) == ["team-a", "team-b"]
    args = operator_container(objs)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args


# --- accelerator catalog override -------------------------------------------------------------------


def test_catalog_override_reaches_the_operator_as_the_file_it_reads(render) -> None:
    from rlfleet import catalog

    override = {
        "h100": {"costPerGpuHour": 1.23},
        "l40s": {
            "name": "l40s",
            "displayName": "NVIDIA L40S",
            "productLabels": ["NVIDIA-L40S"],
            "computeCapability": "8.9",
            "memoryGib": 48,
            "weightFormats": {"bf16": {}},
            "kvCacheDtypes": ["auto", "bf16"],
            "costPerGpuHour": 0.9,
        },
    }
    objs = render({"catalog": {"classes": override}})
    container = operator_container(objs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = Path(env[catalog.CATALOG_ENV])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "catalog"]
    assert path.parent == Path(mount["mountPath"])
    (deployment,) = find(objs, "Deployment")
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "catalog"]
    (configmap,) = find(objs, "ConfigMap", volume["configMap"]["name"])
    loaded = catalog.catalog_from_mapping(yaml.safe_load(configmap["data"][path.name]), source="chart")
    assert loaded.get("h100").cost_per_gpu_hour == 1.23
    assert loaded.get("h100").product_labels == catalog.builtin_classes()["h100"].product_labels  # merged
    assert "l40s" in loaded.names() and "b200" in loaded.names()
    # a catalog change rolls the operator pods (it reads the file at start)
    default_checksum = find(render(), "Deployment")[0]["spec"]["template"]["metadata"]["annotations"][
        "checksum/catalog"
    ]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/catalog"] != default_checksum


def test_default_catalog_configmap_is_a_valid_empty_override(render) -> None:
    from rlfleet import catalog

    (configmap,) = [c for c in find(render(), "ConfigMap") if c["metadata"]["name"].endswith("-catalog")]
    loaded = catalog.catalog_from_mapping(yaml.safe_load(configmap["data"]["catalog.yaml"]), source="chart")
    assert sorted(loaded.names()) == sorted(catalog.builtin_classes())


# --- values schema ------------------------------------------------------------------------------------


def test_weight_stores_reach_the_operator_read_only_and_by_reference(render) -> None:
    """Filesystem stores as read-only volumes at the channels' path; S3 keys as secretKeyRefs only
    (docs/install.md "Weight stores"). The default render has neither."""
    container = operator_container(render())
    assert not [e for e in container["env"] if e["name"].startswith("AWS_")]
    assert [m["name"] for m in container["volumeMounts"]] == ["catalog", "tmp"]
    objs = render(
        {
            "weightStores": {
                "filesystem": [
                    {"name": "weights", "mountPath": "/weights", "claimName": "rlfleet-weights-ro"},
                    {
                        "name": "nfs",
                        "mountPath": "/mnt/nfs",
                        "volume": {"nfs": {"server": "nfs.example", "path": "/w"}},
                    },
                ],
                "s3": {"secretName": "rlfleet-s3", "secretAccessKeyKey": "secret"},
            }
        }
    )
    (deployment,) = find(objs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["store-weights"]["persistentVolumeClaim"] == {
        "claimName": "rlfleet-weights-ro",
        "readOnly": True,
    }
    assert volumes["store-nfs"]["nfs"] == {"server": "nfs.example", "path": "/w"}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["store-weights"] == {"name": "store-weights", "mountPath": "/weights", "readOnly": True}
    assert mounts["store-nfs"]["readOnly"] is True and mounts["store-nfs"]["mountPath"] == "/mnt/nfs"
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {
        "name": "AWS_ACCESS_KEY_ID",
        "valueFrom": {"secretKeyRef": {"name": "rlfleet-s3", "key": "AWS_ACCESS_KEY_ID"}},
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "rlfleet-s3",
        "key": "secret",
    }
    assert all("value" not in e for e in env.values() if e["name"].startswith("AWS_"))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replica": 3}}, "replica"),
        ({"operator": {"logLevel": "warning"}}, "logLevel"),
        ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "watchNamespaces"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"image": {"digest": "latest"}}, "digest"),
        ({"metrics": {"prometheusRule": {"thresholds": {"klRatio": -1}}}}, "klRatio"),
        ({"catalog": {"classes": {"H100!": {}}}}, "H100!"),
        ({"grafana": {"dashbord": {}}}, "dashbord"),
        # S3 keys only by Secret reference: an inline key is not a value the chart has
        ({"weightStores": {"s3": {"accessKey": "AKIA..."}}}, "accessKey"),
        ({"weightStores": {"filesystem": [{"name": "w", "mountPath": "/w"}]}}, "filesystem"),
        (
            {"weightStores": {"filesystem": [{"name": "w", "mountPath": "rel", "claimName": "c"}]}},
            "mountPath",
        ),
        ({"webhook": {"failurePolicy": "Sometimes"}}, "failurePolicy"),
        ({"webhook": {"timeoutSeconds": 31}}, "timeoutSeconds"),
        ({"webhook": {"port": 443}}, "port"),  # the operator runs as uid 10001: no privileged port
        ({"webhook": {"certManager": {"issuer": "x"}}}, "issuer"),
    ],
)
def test_schema_rejects_bad_values_with_the_field_named(render, values: dict[str, Any], message: str) -> None:
    with pytest.raises(Exception, match=re.escape(message)):
        render(values)


# --- monitoring -----------------------------------------------------------------------------------------


def _promql_metric_names(expr: str) -> set[str]:
    import promql_parser

    names: set[str] = set()

    def walk(node: Any) -> None:
        if type(node).__name__ == "VectorSelector":
            names.add(node.name)
            return
        for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
            child = getattr(node, attr, None)
            for item in child if isinstance(child, list) else [child]:
                if item is not None:
                    walk(item)

    walk(promql_parser.parse(expr))
    return names


@pytest.fixture(scope="module")
def exported_metric_names() -> set[str]:
    """Names the code really exports: the router's registry and the trainer's exporter, scraped."""
    from prometheus_client import generate_latest

    from rlfleet.router.metrics import RouterMetrics
    from rlfleet.router.table import RoutingTable
    from rlfleet.trainer.metrics import MEAN_METRICS, PrometheusExporter

    table = RoutingTable()
    table.set_group("h100-fp8", replicas=["http://127.0.0.1:1"], share=1.0)
    table.groups["h100-fp8"].replicas["http://127.0.0.1:1"].observe_version(3)
    router = RouterMetrics(table)
    router.answered("h100-fp8", 200, 0.1, completion=5, prompt=3)
    router.error("h100-fp8", "timeout")
    router.retry("h100-fp8")
    text = generate_latest(router.registry).decode()

    exporter = PrometheusExporter(port=0)
    try:
        # fleet + per-group objective metrics, the rollout metrics and the loop's grad_norm
        # (trainer/loop.py), exactly as the trainer feeds its exporter
        step_metrics = {k: 0.5 for k in MEAN_METRICS}
        step_metrics |= {f"group/h100-fp8/{k}": 0.5 for k in (*MEAN_METRICS, "token_share", "oor_share")}
        step_metrics |= {
            k: 0.1
            for k in (
                "reward_mean",
                "empty_reply_rate",
                "no_tool_call_rate",
                "format_error_rate",
                "grad_norm",
                "test_infra_touched_rate",
            )
        }
        exporter.update(7, step_metrics)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as response:
            text += response.read().decode()
    finally:
        exporter.close()
    names = {
        line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")
    }
    # SGLang's own metrics (references.md; served by the engine, not by our code)
    return names | {"sglang:gen_throughput", "sglang:generation_tokens_total"}


def test_alert_rules_parse_and_use_only_exported_metrics(render, exported_metric_names: set[str]) -> None:
    objs = render({"metrics": {"prometheusRule": {"enabled": True}}})
    (rule,) = find(objs, "PrometheusRule")
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {
        "RLFleetKLSurge",
        "RLFleetRewardCliff",
        "RLFleetEntropyCollapse",
        "RLFleetGradNormSpike",
        "RLFleetTailRatioBlowup",
        "RLFleetToolCallsStopped",
        "RLFleetFormatErrorsRepeat",
        "RLFleetGroupOutOfRangeShare",
        "RLFleetWeightVersionLag",
        "RLFleetPatchesTouchTestInfra",
    } <= set(alerts)
    for name, alert in alerts.items():
        used = _promql_metric_names(alert["expr"])
        assert used and used <= exported_metric_names, (name, used - exported_metric_names)
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"]


def test_alert_thresholds_default_to_the_collapse_detector(render) -> None:
    from rlfleet.trainer.collapse import CollapseThresholds

    defaults = CollapseThresholds()
    values = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["prometheusRule"]["thresholds"]
    pairs = {
        "klRatio": defaults.kl_ratio,
        "oorRatio": defaults.oor_ratio,
        "klFloor": defaults.kl_floor,
        "oorFloor": defaults.oor_floor,
        "entropyMin": defaults.entropy_min,
        "gradRatio": defaults.grad_ratio,
        "rhoMax": defaults.rho_max,
        "rewardCliffAbs": defaults.cliff_abs,
        "rewardCliffRel": defaults.cliff_rel,
        "rateAbs": defaults.rate_abs,
        "formatAbs": defaults.format_abs,
    }
    assert {k: values[k] for k in pairs} == pairs
    objs = render({"metrics": {"prometheusRule": {"enabled": True, "thresholds": {"klRatio": 7.5}}}})
    (rule,) = find(objs, "PrometheusRule")
    (kl,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r["alert"] == "RLFleetKLSurge"]
    assert "> 7.5 * clamp_min" in kl["expr"]


def test_monitoring_is_off_by_default_and_selects_the_operator(render) -> None:
    assert not find(render(), "ServiceMonitor") and not find(render(), "PrometheusRule")
    objs = render({"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    (monitor,) = find(objs, "ServiceMonitor")
    (service,) = find(objs, "Service", "rlfleet-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    (pods,) = find(objs, "PodMonitor")
    targets = {r["targetLabel"] for e in pods["spec"]["podMetricsEndpoints"] for r in e["relabelings"]}
    assert {"rljob", "group"} <= targets


def test_grafana_dashboard_covers_the_fleet(render, exported_metric_names: set[str]) -> None:
    objs = render({"grafana": {"dashboard": {"enabled": True}}})
    (configmap,) = [c for c in find(objs, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["rlfleet.json"])
    assert dashboard["uid"] == "rlfleet-fleet"
    used: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$namespace", "x").replace("$rljob", "x")
            used |= _promql_metric_names(expr)
    assert used <= exported_metric_names, used - exported_metric_names
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for needed in ("throughput", "share", "lag", "kl", "out-of-range", "reward"):
        assert needed in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# --- the chart's arguments against the real CLI ---------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"operator": {"watchNamespaces": ["a", "b"], "logLevel": "debug"}},
        {"operator": {"replicas": 1, "peering": {"enabled": False, "name": "rlfleet"}}},
        {"webhook": {"certManager": {"enabled": True}}},
        {"webhook": {"enabled": False}},
    ],
)
def test_operator_cli_accepts_the_charts_arguments(render, values: dict[str, Any]) -> None:
    from rlfleet.cli import COMMANDS
    from rlfleet.operator.main import parse_args

    args = operator_container(render(values))["args"]
    assert tuple(args[:2]) in COMMANDS and COMMANDS[tuple(args[:2])][0] == "rlfleet.operator.main"
    parsed = parse_args(args[2:])
    watch = values.get("operator", {}).get("watchNamespaces", [])
    assert parsed.all_namespaces is (not watch) and parsed.namespace == watch
    peering = values.get("operator", {}).get("peering", {"enabled": True})
    assert (parsed.peering == "rlfleet") is peering["enabled"] and parsed.standalone is (
        not peering["enabled"]
    )
    assert parsed.verbose is (values.get("operator", {}).get("logLevel") == "debug")
    assert parsed.liveness.endswith(":8080/healthz") and parsed.metrics_port == 9090
    webhook = values.get("webhook", {})
    assert parsed.webhook_port == (None if webhook.get("enabled") is False else 9443)
    # files from cert-manager, or the Secret the operator keeps: never both (main.py refuses that)
    assert bool(parsed.webhook_cert) is bool(webhook.get("certManager"))
    assert bool(parsed.webhook_cert_secret) is (webhook == {})


def test_auto_priorities_of_two_replicas_differ() -> None:
    from rlfleet.operator.main import auto_priority

    names = [f"rlfleet-7d9f8c6b5-{suffix}" for suffix in ("x2k4q", "p9z1m", "a0b1c", "zz9yy")]
    priorities = {auto_priority(name) for name in names}
    assert len(priorities) == len(names) and all(p > 0 for p in priorities)


def test_podmonitor_selects_and_scrapes_the_pods_the_operator_builds(render) -> None:
    """The PodMonitor's selector, ports and relabelled labels match the pod templates of the operator's
    real builders (trainer, router, sampler + weight-sync sidecar) for the example job."""
    templates = {o["metadata"]["name"]: o["spec"]["template"] for o in example_workloads()}

    (monitor,) = find(render({"metrics": {"serviceMonitor": {"enabled": True}}}), "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["metrics"]["workloadLabels"]
    scraped_components = set()
    for name, template in templates.items():
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), name
        named = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        assert named & ports, f"{name}: no container port in {sorted(ports)}"
        assert (
            "rlfleet.dev/job" in labels and labels["rlfleet.dev/job"] == "reference-fleet"
        )  # the example's name
        scraped_components.add(labels["app.kubernetes.io/component"])
        if labels["app.kubernetes.io/component"] == "sampler":
            assert {"http", "sync"} <= named and "rlfleet.dev/group" in labels
    assert scraped_components == {"trainer", "router", "sampler"}
    assert set(values) == {"rlfleet.dev/job", "rlfleet.dev/group", "app.kubernetes.io/component"}


# --- the admission webhook ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kopf_webhook_handlers() -> set[tuple[str, str, str]]:
    """(resource plural, operation, handler id) of every validating handler operator/webhook.py registers,
    read from kopf's registry in a child process (registering them here would put admission handlers in
    this process's kopf registry)."""
    import subprocess
    import sys

    code = (
        "import json, kopf, rlfleet.operator.webhook\n"
        "print(json.dumps([[h.selector.any_name, op, h.id] for h in kopf.get_default_registry()._webhooks"
        ".get_all_handlers() for op in sorted(h.operations)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout
    return {tuple(entry) for entry in json.loads(out)}


def test_webhook_configuration_reaches_every_handler_through_the_service(
    render, kopf_webhook_handlers
) -> None:
    objs = render(namespace="ops")
    container = operator_container(objs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (service,) = find(objs, "Service", "rlfleet-webhook")
    (deployment,) = find(objs, "Deployment")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [
        {"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}
    ]
    assert ports["webhook"] == 9443 and "--webhook-port=9443" in container["args"]
    (configuration,) = find(objs, "ValidatingWebhookConfiguration", "rlfleet-ops")
    served = set()
    for webhook in configuration["webhooks"]:
        assert webhook["clientConfig"] == {
            "service": {
                "name": "rlfleet-webhook",
                "namespace": "ops",
                "port": 443,
                "path": webhook["clientConfig"]["service"]["path"],
            }
        }
        (rule,) = webhook["rules"]
        assert rule["apiGroups"] == ["rlfleet.dev"] and rule["apiVersions"] == ["v1alpha1"]
        (resource,), (operation,) = rule["resources"], rule["operations"]
        served.add((resource, operation, webhook["clientConfig"]["service"]["path"].removeprefix("/")))
        assert webhook["failurePolicy"] == "Ignore" and webhook["sideEffects"] == "None"
        assert webhook["timeoutSeconds"] == 5 and "namespaceSelector" not in webhook  # every namespace
        assert "caBundle" not in webhook["clientConfig"]  # written by the operator, never by helm
    # kopf serves handler <id> at /<id>: each (resource, operation) reaches exactly its handler
    assert served == kopf_webhook_handlers
    assert {(r, o) for r, o, _ in served} == {
        (r, o) for r in ("rljobs", "samplergroups") for o in ("CREATE", "UPDATE")
    }
    assert "annotations" not in configuration["metadata"]
    assert "--webhook-host=rlfleet-webhook.ops.svc" in container["args"]  # the name the API server dials


def test_webhook_self_signed_mode_grants_exactly_its_secret_and_configuration(render) -> None:
    from rlfleet.operator.main import parse_args

    objs = render(namespace="ops")
    args = parse_args(operator_container(objs)["args"][2:])
    assert (args.webhook_cert_secret, args.webhook_configuration) == ("rlfleet-webhook-cert", "rlfleet-ops")
    assert args.webhook_cert is None and args.webhook_key is None and not args.webhook_managed
    env = {e["name"]: e for e in operator_container(objs)["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"  # the Secret's
    (role,) = find(objs, "Role", "rlfleet-webhook")
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["rlfleet-webhook-cert"],
            "verbs": ["get", "patch"],
        },
    ]
    (clusterrole,) = find(objs, "ClusterRole", "rlfleet-ops-webhook")
    assert clusterrole["rules"] == [
        {
            "apiGroups": ["admissionregistration.k8s.io"],
            "resources": ["validatingwebhookconfigurations"],
            "resourceNames": ["rlfleet-ops"],
            "verbs": ["get", "patch"],
        }
    ]
    sa = {"kind": "ServiceAccount", "name": "rlfleet", "namespace": "ops"}
    (binding,) = find(objs, "RoleBinding", "rlfleet-webhook")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "rlfleet-webhook",
    }
    assert binding["subjects"] == [sa] and binding["metadata"]["namespace"] == "ops"
    (cluster_binding,) = find(objs, "ClusterRoleBinding", "rlfleet-ops-webhook")
    assert cluster_binding["roleRef"]["name"] == "rlfleet-ops-webhook" and cluster_binding["subjects"] == [sa]
    assert not [o for o in objs if o["apiVersion"].startswith("cert-manager.io/")]


def test_webhook_cert_manager_mode_mounts_the_certificate_it_renders(render) -> None:
    from rlfleet.operator.main import parse_args

    objs = render({"webhook": {"certManager": {"enabled": True}}}, namespace="ops")
    container = operator_container(objs)
    args = parse_args(container["args"][2:])
    assert args.webhook_cert_secret is None and args.webhook_configuration is None
    (deployment,) = find(objs, "Deployment")
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "webhook-cert"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "webhook-cert"]
    assert mount["readOnly"] is True and "subPath" not in mount  # a subPath would never see a renewal
    assert (args.webhook_cert, args.webhook_key) == (
        f"{mount['mountPath']}/tls.crt",
        f"{mount['mountPath']}/tls.key",
    )
    certificates = {c["metadata"]["name"]: c for c in find(objs, "Certificate")}
    issuers = {i["metadata"]["name"]: i for i in find(objs, "Issuer")}
    serving = certificates["rlfleet-webhook"]
    assert serving["spec"]["secretName"] == volume["secret"]["secretName"] == "rlfleet-webhook-cert"
    assert args.webhook_host in serving["spec"]["dnsNames"] and args.webhook_host == "rlfleet-webhook.ops.svc"
    # the chain: self-signed Issuer -> CA Certificate -> CA Issuer -> serving Certificate
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    ca = certificates["rlfleet-webhook-ca"]
    assert ca["spec"]["isCA"] is True and ca_issuer["spec"] == {
        "ca": {"secretName": ca["spec"]["secretName"]}
    }
    assert issuers[ca["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    assert all(o["metadata"]["namespace"] == "ops" for o in [*certificates.values(), *issuers.values()])
    (configuration,) = find(objs, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "ops/rlfleet-webhook"
    }
    # cainjector writes the caBundle and the Secret is mounted: the operator needs no grant for either
    assert not find(objs, "Role", "rlfleet-webhook") and not find(objs, "ClusterRole", "rlfleet-ops-webhook")
    assert [r["metadata"]["name"] for r in find(objs, "ClusterRole")] == [
        "rlfleet",
        "rlfleet-ops-sandboxes",
        "rlfleet-ops-agent-sandboxes",
    ]


def test_webhook_off_renders_none_of_it(render) -> None:
    objs = render({"webhook": {"enabled": False}}, namespace="ops")
    assert not find(objs, "ValidatingWebhookConfiguration") and not find(objs, "Service", "rlfleet-webhook")
    assert not find(objs, "Role") and [r["metadata"]["name"] for r in find(objs, "ClusterRole")] == [
        "rlfleet",
        "rlfleet-ops-sandboxes",
        "rlfleet-ops-agent-sandboxes",
    ]
    container = operator_container(objs)
    assert not [a for a in container["args"] if a.startswith("--webhook")]
    assert "webhook" not in {p["name"] for p in container["ports"]}


def test_webhook_in_namespace_mode_sees_only_the_watched_namespaces(render) -> None:
    objs = render(
        {"operator": {"watchNamespaces": ["team-a", "team-b"]}, "webhook": {"failurePolicy": "Fail"}},
        namespace="ops",
    )
    (configuration,) = find(objs, "ValidatingWebhookConfiguration")
    for webhook in configuration["webhooks"]:
        assert webhook["namespaceSelector"] == {
            "matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}
            ]
        }
        assert webhook["failurePolicy"] == "Fail"
    # the Secret lives in the release namespace, whatever the operator watches
    (role,) = find(objs, "Role", "rlfleet-webhook")
    assert role["metadata"]["namespace"] == "ops"


def test_network_policy_settings_reach_the_operator_as_it_reads_them(render) -> None:
    """networkPolicy.* become the operator's environment; what it reads back (operator/network_policies.py)
    names the operator's own pods (the Deployment's pod labels) and the scrapers the values give."""
    from rlfleet.operator.network_policies import (
        DEFAULT_METRICS_FROM,
        NetworkPolicySettings,
        settings_from_env,
    )

    def settings(values: dict[str, Any] | None) -> NetworkPolicySettings | None:
        objs = render(values)
        env = {e["name"]: e.get("value") for e in operator_container(objs)["env"]}
        env["POD_NAMESPACE"] = "rlfleet-system"  # the fieldRef's value in the pod
        (deployment,) = find(objs, "Deployment")
        out = settings_from_env(env)
        if out is not None:
            pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
            assert out.operator_pod_labels and out.operator_pod_labels.items() <= pod_labels.items()
            assert dict(out.operator_pod_labels) == deployment["spec"]["selector"]["matchLabels"]
        return out

    default = settings(None)
    assert default is not None and default.operator_namespace == "rlfleet-system"
    assert default.metrics_from == DEFAULT_METRICS_FROM
    scrapers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    custom = settings({"networkPolicy": {"metricsFrom": scrapers}})
    assert custom is not None and list(custom.metrics_from) == scrapers
    assert settings({"networkPolicy": {"enabled": False}}) is None
