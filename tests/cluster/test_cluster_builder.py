"""The builder table, the pinned wrapper modules and the fake node pool (no control plane needed,
except the cache test, which needs the binaries `scripts/test` builds first)."""

from __future__ import annotations

import re

import pytest
from support.cluster_modules import cluster_module

cp = cluster_module("controlplane")

STAGING = (
    "api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider cluster-bootstrap "
    "code-generator component-base component-helpers controller-manager cri-api cri-client cri-streaming "
    "csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms kube-aggregator "
    "kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics mount-utils "
    "pod-security-admission sample-apiserver sample-cli-plugin sample-controller streaming"
).split()


def test_kubernetes_wrapper_pins_every_staging_module_to_the_matching_release() -> None:
    version = cp.COMPONENTS["kubernetes"].version()
    staging_version = "v0." + version.split(".", 1)[1]  # v1.36.3 -> v0.36.3
    gomod = (cp.GO_DIR / "kubernetes" / "go.mod").read_text()
    replaced = dict(re.findall(r"^\s*k8s\.io/(\S+) => k8s\.io/\S+ (v\S+)$", gomod, re.MULTILINE))
    assert sorted(replaced) == sorted(STAGING)
    assert set(replaced.values()) == {staging_version}


@pytest.mark.parametrize("name", sorted(cp.COMPONENTS))
def test_every_component_has_a_tidy_wrapper_module(name: str) -> None:
    component = cp.COMPONENTS[name]
    assert re.fullmatch(r"v\d+\.\d+\.\d+", component.version())
    gosum = (component.wrapper_dir / "go.sum").read_text()
    assert f"{component.module} {component.version()} h1:" in gosum  # pinned by hash, offline-verifiable
    own = re.search(r"^module (\S+)$", (component.wrapper_dir / "go.mod").read_text(), re.MULTILINE).group(1)
    for package in component.binaries.values():
        if (
            package == own
        ):  # the wrapper's own main package (coredns: the plugins we use) built from the module
            assert f'"{component.module}/' in (component.wrapper_dir / "main.go").read_text()
        else:
            assert package.startswith(component.module)


def test_binary_names_skip_major_version_suffixes() -> None:
    assert cp._default_binary_name("go.etcd.io/etcd/server/v3") == "server"
    assert cp._default_binary_name("k8s.io/kubernetes/cmd/kubectl") == "kubectl"


def test_unknown_component_is_a_clear_error() -> None:
    with pytest.raises(cp.BuildError, match="unknown component"):
        cp.build(["kubelet-nope"])


def test_node_pool_matches_the_gpu_catalogue() -> None:
    nodes = {n["metadata"]["name"]: n for n in cp.node_manifests()}
    assert len(nodes) == 2 * 6 + 2
    expected = {
        "a100": ("NVIDIA-A100-SXM4-80GB", "ampere", "8", "0"),
        "h100": ("NVIDIA-H100-80GB-HBM3", "hopper", "9", "0"),
        "h200": ("NVIDIA-H200", "hopper", "9", "0"),
        "b200": ("NVIDIA-B200", "blackwell", "10", "0"),
        "b300": ("NVIDIA-B300-SXM6-AC", "blackwell", "10", "3"),
        "rtx-pro-6000": ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "blackwell", "12", "0"),
    }
    for cls, (product, family, major, minor) in expected.items():
        for name in (f"gpu-{cls}-0", f"gpu-{cls}-1"):
            labels = nodes[name]["metadata"]["labels"]
            assert (
                labels["nvidia.com/gpu.product"],
                labels["nvidia.com/gpu.family"],
                labels["nvidia.com/gpu.compute.major"],
                labels["nvidia.com/gpu.compute.minor"],
            ) == (product, family, major, minor)
            assert int(labels["nvidia.com/gpu.memory"]) > 40_000  # MiB
            assert nodes[name]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
            assert nodes[name]["spec"]["taints"] == [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
            ]
        assert "cloud.google.com/gke-accelerator" in nodes[f"gpu-{cls}-1"]["metadata"]["labels"]
    assert nodes["cpu-0"]["spec"]["taints"] == []


@pytest.mark.cluster
def test_cached_build_does_not_touch_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second build is instant: with up-to-date stamps the Go toolchain is never called."""
    if not all(cp.COMPONENTS[n].up_to_date() for n in cp.CONTROL_PLANE_COMPONENTS):
        cp.build(cp.CONTROL_PLANE_COMPONENTS)

    def no_go() -> str:
        raise AssertionError("go was called although the binaries are cached")

    monkeypatch.setattr(cp, "go_binary", no_go)
    out = cp.build(cp.CONTROL_PLANE_COMPONENTS)
    assert (out["kubernetes"] / "kube-apiserver").is_file()
    assert out["etcd"].name == f"etcd-{cp.COMPONENTS['etcd'].version()}"
