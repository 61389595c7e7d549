"""Fixtures of the ship tests: the helm binary (built from its Go module by tests/cluster/controlplane.py,
cached) and a renderer of the chart."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cluster_modules import cluster_module

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rlfleet"
KUBE_VERSION = "v1.36.3"  # the control plane the cluster tests run (tests/cluster/go/kubernetes)


def _controlplane():
    return cluster_module("controlplane")


def _go_tool(name: str) -> Path:
    """A Go tool of the builder table (tests/cluster/controlplane.py), built once and cached."""
    out = _controlplane().build([name], log=lambda msg: print(f"[{name}] {msg}", file=sys.stderr))
    return out[name] / name


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    """helm built from tests/cluster/go/helm (minutes when cold, instant when cached)."""
    return _go_tool("helm")


@pytest.fixture(scope="session")
def actionlint_bin() -> Path:
    """actionlint built from tests/cluster/go/actionlint (about a minute when cold), for the release workflow."""
    return _go_tool("actionlint")


@pytest.fixture(scope="session")
def nodeimages() -> Any:
    """tests/cluster/nodeimages.py: what the dev cluster's real node builds from images/Dockerfile.*."""
    return cluster_module("nodeimages")


class HelmError(RuntimeError):
    pass


def run_helm(helm_bin: Path, *args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(helm_bin), *args], capture_output=True, text=True, timeout=120, env=env)
    if result.returncode != 0:
        raise HelmError(result.stderr.strip() or result.stdout.strip())
    return result.stdout


@pytest.fixture(scope="session")
def render(helm_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., list[dict[str, Any]]]:
    """render(values: dict | None, namespace='rlfleet-system', include_crds=False) -> rendered objects."""
    tmp = tmp_path_factory.mktemp("values")

    def _render(
        values: dict[str, Any] | None = None, namespace: str = "rlfleet-system", include_crds: bool = False
    ) -> list[dict[str, Any]]:
        args = ["template", "rlfleet", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
        if values:
            path = tmp / f"values-{abs(hash(json.dumps(values, sort_keys=True)))}.yaml"
            path.write_text(yaml.safe_dump(values))
            args += ["--values", str(path)]
        if include_crds:
            args.append("--include-crds")
        return [d for d in yaml.safe_load_all(run_helm(helm_bin, *args)) if d]

    return _render


@pytest.fixture(scope="session")
def helm(helm_bin: Path) -> Callable[..., str]:
    """helm(*args, env=None) -> stdout; raises HelmError with helm's message on failure."""
    return lambda *args, env=None: run_helm(helm_bin, *args, env=env)


@pytest.fixture(scope="session")
def promtool_bin() -> Path:
    """promtool built from tests/cluster/go/promtool (cached like the control plane's binaries)."""
    cp = _controlplane()
    component = cp.COMPONENTS["promtool"]
    out = cp.build_component(component, log=lambda msg: print(f"[promtool] {msg}", file=sys.stderr))
    return out / "promtool"
