"""The validating webhook enforces the LIVE accelerator catalog at `kubectl apply` (real kube-apiserver ->
kopf's webhook server over TLS), where the CRD's CEL only knows the built-in catalog.

The operator runs as `rlfleet operator run --webhook-port ...` in a subprocess: that is the production
path, and it keeps the admission handlers out of this test process's global kopf registry (an in-process
runner started later without a webhook server would refuse to run with them registered)."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.ports import free_port
from support.waits import wait_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_webhook_rejects_what_the_runtime_catalog_cannot_run(
    kube, crds, namespace: str, tmp_path: Path
) -> None:
    from rlfleet.catalog import check_group, load_catalog
    from rlfleet.operator.certs import self_signed

    # this cluster's H100 nodes may not keep an FP8 KV cache (an operator-side policy the CRD cannot know)
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("classes:\n  h100:\n    kvCacheDtypes: [auto, bf16]\n")
    certfile, keyfile, ca = self_signed("127.0.0.1", tmp_path)
    port = free_port()
    env = {**kube.env(), "RLFLEET_CATALOG": str(catalog)}
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
                ],
                # only this test's namespace: other tests share the control plane
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 10,
            }
        ],
    }
    argv = [
        sys.executable,
        "-c",
        "from rlfleet.cli import main; raise SystemExit(main())",
        "operator",
        "run",
        "--standalone",
        "--namespace",
        namespace,
        "--kubeconfig",
        str(kube.kubeconfig),
        "--webhook-port",
        str(port),
        "--webhook-address",
        "127.0.0.1",
        "--webhook-host",
        "127.0.0.1",
        "--webhook-cert",
        str(certfile),
        "--webhook-key",
        str(keyfile),
    ]
    log = tmp_path / "operator.log"
    other_namespace = f"{namespace}-other"  # no webhook there (namespaceSelector): another team's job
    operator = subprocess.Popen(  # noqa: S603
        argv, env=env, cwd="/", stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        if True:  # the operator subprocess runs for the whole block

            def listening() -> bool:
                assert operator.poll() is None, log.read_text()
                with socket.socket() as s:
                    return s.connect_ex(("127.0.0.1", port)) == 0

            wait_for("the operator's webhook port", listening, timeout=60, interval=0.2)
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
            # child names colliding with another job's (CEL sees one object; the webhook the namespace):
            # job "reference" + group "fleet-h100-fp8" would be reference-fleet's group h100-fp8
            sg = "reference-fleet-h100-fp8"
            wait_for(
                f"the operator to create {sg}",
                lambda: kube.kubectl("get", "sg", sg, "-n", namespace, check=False).returncode == 0,
            )
            clash = json.loads(json.dumps(EXAMPLE))
            clash["metadata"]["name"] = "reference"
            clash["spec"]["samplerGroups"][2]["name"] = "fleet-h100-fp8"
            result = kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(clash), check=False)
            assert result.returncode != 0, "the webhook let a colliding child name through"
            assert f"is taken by SamplerGroup {sg} of RLJob reference-fleet" in result.stderr, result.stderr
            refuses_a_second_job_on_one_weight_store(kube, namespace, other_namespace)
        assert operator.poll() is None, log.read_text()
    finally:
        kube.kubectl(
            "delete", "namespace", other_namespace, "--ignore-not-found", "--wait=false", check=False
        )
        if operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
                operator.wait()
        kube.kubectl(
            "delete", "validatingwebhookconfiguration", config_name, "--ignore-not-found", check=False
        )


def refuses_a_second_job_on_one_weight_store(kube, namespace: str, other_namespace: str) -> None:
    """One trainer per weight channel (docs/weights.md, "One writer per channel"): with reference-fleet
    running on PersistentVolumeClaim rlfleet-weights, a job of another name on that claim is refused
    (the claim's root is the channel, whatever the path), naming reference-fleet; an S3 bucket is global,
    so a job here whose prefix lies under the prefix of a job in ANOTHER namespace is refused naming that
    one, and a sibling prefix is admitted (a server-side dry run: it passes admission, nothing is created)."""

    def job(name: str, store: dict) -> str:
        manifest = json.loads(json.dumps(EXAMPLE))
        manifest["metadata"]["name"] = name
        manifest["spec"]["weightChannel"]["store"] = store
        return json.dumps(manifest)

    claim = {"type": "filesystem", "path": "/weights/second", "volumeClaimName": "rlfleet-weights"}
    result = kube.kubectl("apply", "-n", namespace, "-f", "-", input=job("second", claim), check=False)
    assert result.returncode != 0, "the webhook let a second job onto reference-fleet's weight store"
    assert (
        f"its weight store PersistentVolumeClaim rlfleet-weights (mounted at /weights/second) overlaps the "
        f"store PersistentVolumeClaim rlfleet-weights (mounted at /weights/reference-fleet) of RLJob "
        f"{namespace}/reference-fleet: one trainer per weight channel"
    ) in result.stderr, result.stderr
    kube.kubectl("create", "namespace", other_namespace)
    kube.kubectl(
        "apply",
        "-n",
        other_namespace,
        "-f",
        "-",
        input=job("holder", {"type": "s3", "bucket": "rlfleet-shared", "prefix": "jobs"}),
    )
    nested = job("nested", {"type": "s3", "bucket": "rlfleet-shared", "prefix": "jobs/run-1"})
    result = kube.kubectl("apply", "-n", namespace, "-f", "-", input=nested, check=False)
    assert result.returncode != 0, "the webhook let a job under another namespace's S3 prefix through"
    assert (
        f"its weight store s3://rlfleet-shared/jobs/run-1 overlaps the store s3://rlfleet-shared/jobs of "
        f"RLJob {other_namespace}/holder"
    ) in result.stderr, result.stderr
    sibling = job("sibling", {"type": "s3", "bucket": "rlfleet-shared", "prefix": "runs/run-1"})
    kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=sibling)
