"""charts/rlfleet installed with helm on the dev cluster (the real-node tier): the operator from an image
loaded on the node, as a user installs the chart."""

from __future__ import annotations

import json
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


def install_operator_reading_claim(
    kube: Any, operator_image: str, namespace: str, *, store: str, claim: str, mount_path: str
) -> None:
    """install_operator_chart with one filesystem weight store, the job's claim `claim` mounted read-only at
    the store's `mount_path`: the operator reads the channel from it, so it runs in the job's namespace (a
    PVC cannot be mounted from another one). Its pod waits for the claim, which the example creates or the
    test binds. Asserts helm succeeded."""
    stores = [{"name": store, "claimName": claim, "mountPath": mount_path}]
    install = install_operator_chart(
        kube,
        operator_image,
        namespace,
        "--set-json",
        f"weightStores.filesystem={json.dumps(stores)}",
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr


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
