"""The operator's Kubernetes client (kubernetes_asyncio, kopf's credentials) against the real control plane:
server-side apply under a field manager (idempotent, forced over another manager), the status subresource
under its own manager, get/create/delete on plain dicts, and the API's refusal as a KubeError."""

from __future__ import annotations

import json

import kopf
import pytest

from rlfleet.operator import kube as client
from rlfleet.operator.naming import FIELD_MANAGER, STATUS_FIELD_MANAGER

pytestmark = pytest.mark.cluster


async def test_apply_status_get_create_delete(
    kube, crds, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())  # what the login handler returns
    assert info is not None
    api = client.KubeApi(info)
    try:
        cm = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "namespace": namespace},
            "data": {"a": "1"},
        }
        first = await api.apply(cm)
        again = await api.apply(cm)
        assert (
            first["data"] == {"a": "1"}
            and again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        )
        kube.kubectl("patch", "configmap", "c", "-n", namespace, "--type=merge", "-p", '{"data":{"a":"2"}}')
        assert (await api.apply(cm))["data"] == {"a": "1"}  # forced: the field is the operator's again
        managers = {
            m["manager"]
            for m in kube.get_json("configmap", "c", "-n", namespace, "--show-managed-fields")["metadata"][
                "managedFields"
            ]
        }
        assert FIELD_MANAGER in managers
        assert (await api.get("v1", "ConfigMap", namespace, "c"))["data"] == {"a": "1"}
        assert await api.get("v1", "ConfigMap", namespace, "nope") is None
        assert await api.create(cm) is None  # already there

        wc = {
            "apiVersion": "rlfleet.dev/v1alpha1",
            "kind": "WeightChannel",
            "metadata": {"name": "w", "namespace": namespace},
            "spec": {"store": {"type": "filesystem", "path": "/w"}},
        }
        await api.apply(wc)
        written = await api.patch_status(wc, {"phase": "Pending", "message": "m"})
        assert written is not None and written["status"]["phase"] == "Pending"
        live = json.loads(
            kube.kubectl("get", "wc", "w", "-n", namespace, "-o", "json", "--show-managed-fields").stdout
        )
        status_managers = {
            m["manager"] for m in live["metadata"]["managedFields"] if m.get("subresource") == "status"
        }
        assert status_managers == {STATUS_FIELD_MANAGER}
        assert (
            await api.patch_status(
                {**wc, "metadata": {"name": "gone", "namespace": namespace}}, {"phase": "Pending"}
            )
            is None
        )

        with pytest.raises(
            client.KubeError
        ) as refused:  # the CRD's schema refuses it: 422 with the API's message
            await api.apply({**wc, "spec": {"store": {"type": "nfs"}}})
        assert refused.value.status == 422 and "store" in refused.value.message

        assert await api.delete("v1", "ConfigMap", namespace, "c") is True
        assert await api.delete("v1", "ConfigMap", namespace, "c") is False
    finally:
        await api.close()
