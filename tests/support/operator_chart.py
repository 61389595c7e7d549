"""charts/rlfleet installed with helm on the dev cluster (the real-node tier): the operator from an image
loaded on the node, as a user installs the chart."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parents[2] / "charts" / "rlfleet"
RELEASE = "rlfleet"


def install_operator_chart(
    kube: Any, operator_image: str, namespace: str, *flags: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`helm install rlfleet charts/rlfleet` into `namespace` (created): the operator from `operator_image`
    (loaded on the node, so never pulled), one replica; `flags` follow (more values, `--wait`). Returns
    helm's outcome for the test to assert on."""
    repository, tag = operator_image.rsplit(":", 1)
    return subprocess.run(
        [
            str(kube.bin_dir / "helm"),
            "install",
            RELEASE,
            str(CHART),
            "-n",
            namespace,
            "--create-namespace",
            "--set",
            f"image.repository={repository}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "image.pullPolicy=Never",
            "--set",
            "operator.replicas=1",
            *flags,
        ],
        env=kube.env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def uninstall_operator_chart(kube: Any, namespace: str) -> None:
    """`helm uninstall` of that release, waiting until its objects are gone; a teardown step, so its
    outcome is not checked (the test's own assertions already failed or passed)."""
    subprocess.run(
        [str(kube.bin_dir / "helm"), "uninstall", RELEASE, "-n", namespace, "--wait"],
        env=kube.env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
