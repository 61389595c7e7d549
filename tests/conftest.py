"""Shared pytest configuration.

`kube` (session scope): a real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, kwok fake GPU/CPU nodes) built from Go modules by tests/cluster/controlplane.py. It is
started lazily, once per session, on free ports in a temp dir, and stopped at session end. Set
RLFLEET_KUBE_WORKDIR=<dir of a `controlplane.py up`> to reuse a running one instead (fast iteration).
`namespace` (function scope): a fresh namespace, deleted afterwards. `crds` (session scope): rlfleet's CRDs
installed on it. Helpers the test files share are in tests/support/. See docs/testing.md.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from support.cluster_modules import cluster_module

# Property tests are derandomised (a fixed example sequence per test, no example database), so CI is
# deterministic: a failure found once is found on every run. HYPOTHESIS_PROFILE=explore searches anew.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def kube() -> Iterator:
    """The running control plane: a `controlplane.KubeCluster`.

    Attributes: kubeconfig, kubectl_bin, bin_dir, server, gpu_nodes {class: [node, ...]}, cpu_nodes,
    start_seconds; methods env(), kubectl(*args, input=None, check=True), api_client(), get_json(*args).
    """
    cp = cluster_module("controlplane")
    attach = os.environ.get("RLFLEET_KUBE_WORKDIR")
    if attach:
        yield cp.KubeCluster.from_state(Path(attach))
        return
    workdir = cp.scratch_dir()
    plane = cp.ControlPlane(workdir, log=lambda msg: print(f"[controlplane] {msg}", file=sys.stderr))
    try:
        cluster = plane.start()
        print(
            f"\n[controlplane] started in {cluster.start_seconds:.1f}s at {cluster.server}", file=sys.stderr
        )
        yield cluster
    finally:
        try:
            plane.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def crds(kube) -> None:
    """rlfleet's CRDs installed and Established on the control plane (support/control_plane.py)."""
    from support.control_plane import install_crds

    install_crds(kube)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """2 shared cores: torch's default 2-thread pool spins against other processes (30x slower here).

    Test files that run torch models use it with `pytestmark = pytest.mark.usefixtures(...)`."""
    import torch  # only the files that use it pay for the import

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen3 checkpoint (rlfleet/tiny_qwen3.py, default sizes: every projection a
    multiple of 128, so bf16, fp8 and nvfp4 views all publish), built once per session. Read-only:
    tests that change a checkpoint build their own."""
    from rlfleet.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3") / "model")


@pytest.fixture(scope="session")
def tiny_qwen3_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`build(**fields) -> checkpoint dir`: a tiny Qwen3 of `rlfleet.tiny_qwen3.TinyQwen3(**fields)`
    (smaller sizes for tests that publish no fp8 view), built once per spec per session. Read-only."""
    from rlfleet.tiny_qwen3 import TinyQwen3, cached_tiny_qwen3

    root = tmp_path_factory.mktemp("tiny-qwen3-sized")

    def build(**fields: Any) -> Path:
        return cached_tiny_qwen3(root, TinyQwen3(**fields))

    return build


@pytest.fixture
def namespace(kube) -> Iterator[str]:
    """A fresh namespace for one test (support/control_plane.py); deleted (without waiting) afterwards."""
    from support.control_plane import fresh_namespace

    with fresh_namespace(kube, "t") as name:
        yield name


@pytest.fixture
def example_run() -> Callable[..., Any]:
    """`example_run(**fields) -> RunConfig`: the typed training spec local mode resolves from
    examples/rljob.yaml (trainer/config.py `resolve_run`), with `fields` replaced; `groups` may be
    given as (name, weight format) pairs."""
    from dataclasses import replace

    from rlfleet.api import load_rljob
    from rlfleet.trainer.config import GroupSpec, resolve_run

    base = resolve_run(
        load_rljob(Path(__file__).resolve().parents[1] / "examples" / "rljob.yaml"), local=True
    )

    def make(**fields: Any) -> Any:
        if "groups" in fields:
            fields["groups"] = [
                g if isinstance(g, GroupSpec) else GroupSpec(g[0], "cpu", g[1]) for g in fields["groups"]
            ]
        return replace(base, **fields)

    return make
