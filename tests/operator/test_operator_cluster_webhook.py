"""The validating webhook enforces the LIVE accelerator catalog at `kubectl apply` (real kube-apiserver ->
kopf's webhook server over TLS), where the CRD's CEL only knows the built-in catalog."""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path

import pytest
import yaml
from kopf.testing import KopfRunner

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_webhook_rejects_what_the_runtime_catalog_cannot_run(
    kube, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlfleet.catalog import check_group, load_catalog
    from rlfleet.operator.webhook import self_signed

    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "crd/rljobs.rlfleet.dev", "--timeout=60s")
    # this cluster's H100 nodes may not keep an FP8 KV cache (an operator-side policy the CRD cannot know)
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("classes:\n  h100:\n    kvCacheDtypes: [auto, bf16]\n")
    certfile, keyfile, ca = self_signed("127.0.0.1", tmp_path)
    port = free_port()
    for key, value in {
        "KUBECONFIG": str(kube.kubeconfig), "RLFLEET_CATALOG": str(catalog), "RLFLEET_WEBHOOK_PORT": str(port),
        "RLFLEET_WEBHOOK_ADDR": "127.0.0.1", "RLFLEET_WEBHOOK_HOST": "127.0.0.1",
        "RLFLEET_WEBHOOK_CERT": str(certfile), "RLFLEET_WEBHOOK_KEY": str(keyfile),
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    config_name = f"rlfleet-test-{namespace}"
    webhook = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": config_name},
        "webhooks": [
            {
                "name": f"rljobs.{namespace}.rlfleet.dev",
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/validate-rljob",
                    "caBundle": base64.b64encode(ca).decode(),
                },
                "rules": [
                    {
                        "apiGroups": ["rlfleet.dev"],
                        "apiVersions": ["v1alpha1"],
                        "operations": ["CREATE"],
                        "resources": ["rljobs"],
                    }
                ],  # fmt: skip
                # only this test's namespace: other tests share the control plane
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            }
        ],
    }
    args = [
        "run",
        "--standalone",
        "--namespace",
        namespace,
        "-m",
        "rlfleet.operator.handlers",
        "-m",
        "rlfleet.operator.webhook",
    ]
    try:
        with KopfRunner(args, timeout=60) as runner:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.2)
            kube.kubectl("apply", "-f", "-", input=json.dumps(webhook))
            bad = json.loads(json.dumps(EXAMPLE))
            bad["metadata"]["name"] = "h100-kv-fp8"
            bad["spec"]["samplerGroups"][3]["kvCacheDtype"] = "fp8_e4m3"
            result = kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
            assert result.returncode != 0, "the webhook let an h100 fp8 KV cache through"
            assert "rejected by rlfleet (catalog in effect)" in result.stderr, result.stderr
            assert "accelerator h100 (sm90) cannot use kvCacheDtype fp8_e4m3" in result.stderr, result.stderr
            # the built-in catalog (hence the CRD's CEL) allows it: the rule came from the live catalog
            check_group("h100", "bf16", "fp8_e4m3", catalog=load_catalog(None))
            # and a valid job passes the webhook
            kube.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "rljob.yaml"))
        assert runner.exception is None, runner.output
    finally:
        kube.kubectl(
            "delete", "validatingwebhookconfiguration", config_name, "--ignore-not-found", check=False
        )
