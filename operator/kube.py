"""A small async Kubernetes REST client for the operator: server-side apply, get, list, delete.

kopf watches and runs handlers; children are written with this client because kopf has no public
server-side-apply API. It reuses kopf's credentials (`kopf.ConnectionInfo`: kubeconfig or in-cluster
service account) and one aiohttp session per event loop. Only the kinds the operator touches are
known (no discovery round trips).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import kopf
import yaml

from rlfleet.api.common import API_VERSION
from rlfleet.operator.naming import FIELD_MANAGER

# (apiVersion, kind) -> plural. Everything the operator reads or writes.
RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    (API_VERSION, "RLJob"): "rljobs",
    (API_VERSION, "SamplerGroup"): "samplergroups",
    (API_VERSION, "WeightChannel"): "weightchannels",
}


class KubeError(Exception):
    """A failed API call: HTTP status + the API's Status message."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:  # fmt: skip
    """URL path of a namespaced collection / object / subresource."""
    try:
        plural = RESOURCES[(api_version, kind)]
    except KeyError:
        raise ValueError(f"kind {api_version}/{kind} is not known to the operator's client") from None
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace or 'default')}/{plural}"
    if name:
        path += f"/{quote(name)}"
        if subresource:
            path += f"/{subresource}"
    return path


def connection_from_kubeconfig(path: str | os.PathLike[str]) -> kopf.ConnectionInfo:
    """kopf.ConnectionInfo from a kubeconfig file (current context; embedded data or file paths)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    current = config.get("current-context")
    contexts = {c["name"]: c.get("context") or {} for c in config.get("contexts", [])}
    if current not in contexts:
        raise kopf.LoginError(f"kubeconfig {path}: current context {current!r} not found")
    context = contexts[current]
    cluster = {c["name"]: c.get("cluster") or {} for c in config.get("clusters", [])}[context["cluster"]]
    user = {u["name"]: u.get("user") or {} for u in config.get("users", [])}[context["user"]]
    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_path=cluster.get("certificate-authority"),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=cluster.get("insecure-skip-tls-verify"),
        certificate_path=user.get("client-certificate"),
        certificate_data=user.get("client-certificate-data"),
        private_key_path=user.get("client-key"),
        private_key_data=user.get("client-key-data"),
        token=user.get("token"),
        scheme="Bearer" if user.get("token") else None,
        default_namespace=context.get("namespace"),
    )


class KubeApi:
    """Async client bound to one event loop."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        self.server = info.server.rstrip("/")
        headers = {"User-Agent": "rlfleet-operator", **info.as_http_headers()}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=32, ssl=info.as_ssl_context()),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=60),
        )

    async def close(self) -> None:
        await self.session.close()

    async def _request(self, method: str, path: str, *, query: dict[str, Any] | None = None,
                       body: Any = None, content_type: str = "application/json") -> Any:  # fmt: skip
        url = self.server + path + (f"?{urlencode(query)}" if query else "")
        data = json.dumps(body) if body is not None else None
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self.session.request(method, url, data=data, headers=headers) as response:
            text = await response.text()
            if response.status >= 400:
                try:
                    status = json.loads(text)
                    message, reason = status.get("message", text), status.get("reason", "")
                except ValueError:
                    message, reason = text, ""
                raise KubeError(response.status, message, reason)
            return json.loads(text) if text else None

    async def apply(self, body: dict[str, Any], *, field_manager: str = FIELD_MANAGER, subresource: str | None = None,
                    force: bool = True) -> dict[str, Any]:  # fmt: skip
        """Server-side apply of `body` (as `field_manager`, taking over conflicting fields when forced)."""
        meta = body["metadata"]
        path = resource_path(
            body["apiVersion"], body["kind"], meta.get("namespace"), meta["name"], subresource
        )
        query = {"fieldManager": field_manager, "fieldValidation": "Strict"}
        if force:
            query["force"] = "true"
        return await self._request(
            "PATCH", path, query=query, body=body, content_type="application/apply-patch+yaml"
        )

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", resource_path(api_version, kind, namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str | None = None
    ) -> list[dict]:
        query = {"labelSelector": label_selector} if label_selector else None
        result = await self._request("GET", resource_path(api_version, kind, namespace), query=query)
        return list(result.get("items", []))

    async def create(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Create; None if it already exists (for objects created once, e.g. a generated Secret)."""
        meta = body["metadata"]
        try:
            return await self._request("POST", resource_path(body["apiVersion"], body["kind"], meta.get("namespace")),
                                       body=body)  # fmt: skip
        except KubeError as exc:
            if exc.status == 409:
                return None
            raise

    async def delete(self, api_version: str, kind: str, namespace: str, name: str,
                     propagation: str = "Background") -> bool:  # fmt: skip
        """Delete; False if it was already gone."""
        try:
            await self._request(
                "DELETE",
                resource_path(api_version, kind, namespace, name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation},
            )
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise


# --- one client per event loop, built from the credentials kopf logged in with -----------------------
_connection: kopf.ConnectionInfo | None = None
_apis: dict[asyncio.AbstractEventLoop, KubeApi] = {}


def set_connection(info: kopf.ConnectionInfo) -> None:
    global _connection
    _connection = info


def api() -> KubeApi:
    """The client of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    client = _apis.get(loop)
    if client is None:
        if _connection is None:
            raise RuntimeError("not logged in: the kopf login handler has not run")
        client = _apis[loop] = KubeApi(_connection)
    return client


async def close_api() -> None:
    loop = asyncio.get_running_loop()
    client = _apis.pop(loop, None)
    if client is not None:
        await client.close()
