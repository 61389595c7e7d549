"""The operator's Kubernetes client: kubernetes_asyncio's dynamic client, with server-side apply.

kopf watches and runs handlers; children and status are written with this client because kopf has no
public server-side-apply API. The client is kubernetes_asyncio (maintained, async, `server_side_apply`
of arbitrary dicts with a field manager and force, status subresources); the operator's callers use a
small interface (`apply`, `patch_status`, `get`, `list`, `create`, `delete`) on plain dicts; what the
operator watches it reads from kopf's indexes. The one listing is the webhook's (`list`): it answers on
every replica, and a standby replica's indexes are empty (kopf pauses its watches, docs/install.md).

Credentials: kopf's (`kopf.ConnectionInfo` from the login handler: kubeconfig or in-cluster service
account) are the single source: the client's HTTP session is built from `info.as_ssl_context()` and
`info.as_http_headers()`, never from a second kubeconfig parse. One client per event loop; kinds are
resolved by the API server's discovery (cached by the library, per client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import Awaitable, Mapping
from typing import Any, cast

import aiohttp
import kopf
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.rest import ApiException
from kubernetes_asyncio.dynamic import DynamicClient
from kubernetes_asyncio.dynamic.exceptions import ResourceNotFoundError

from rlfleet.operator.naming import FIELD_MANAGER, STATUS_FIELD_MANAGER

REQUEST_TIMEOUT_SECONDS = 60


class KubeError(Exception):
    """A failed API call: HTTP status + the API's Status message."""

    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"HTTP {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message


async def _result(call: Awaitable[Any]) -> Any:
    """The API's JSON of a dynamic-client call made with `serialize=False` (its raw aiohttp response), or
    KubeError with the API's Status. The dynamic client streams responses (`_preload_content=False`), so
    it does not raise on HTTP errors itself: the status is checked here."""
    try:
        response = await call
    except ApiException as exc:  # raised by the library before the request (e.g. bad arguments)
        raise KubeError(int(exc.status or 0), str(exc.reason or exc), "") from None
    text = await response.text()
    try:
        data = json.loads(text) if text else None
    except ValueError:
        data = None
    if response.status >= 400:
        message = data.get("message", text) if isinstance(data, dict) else text
        reason = data.get("reason", "") if isinstance(data, dict) else str(response.reason or "")
        raise KubeError(response.status, message, reason)
    return data


async def _none_on(status: int, request: Awaitable[Any]) -> Any:
    """The request's answer, or None if the API answered `status` (404: the object is gone; 409: it
    exists already); any other KubeError is raised."""
    try:
        return await request
    except KubeError as exc:
        if exc.status == status:
            return None
        raise


def status_apply_body(obj: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """Body of a server-side apply of the status subresource: identity + the fields this writer owns."""
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": obj["metadata"]["name"], "namespace": obj["metadata"].get("namespace")},
        "status": dict(status),
    }


def event_target(obj: Mapping[str, Any]) -> kopf.Body:
    """A raw object (an index's or a pipeline's copy) as the kopf.Body that kopf.event/info/warn post on:
    they read only its apiVersion, kind and metadata (the Event's involvedObject), which a raw object has
    alike."""
    return kopf.Body(cast(kopf.RawBody, obj))


class KubeApi:
    """Async client bound to one event loop (kubernetes_asyncio ApiClient + DynamicClient)."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        config = Configuration(host=info.server.rstrip("/"))
        self.client = ApiClient(config)
        self.client.user_agent = "rlfleet-operator"
        for key, value in info.as_http_headers().items():
            self.client.set_default_header(key, value)
        self._ssl = info.as_ssl_context()
        self._dynamic: DynamicClient | None = None
        self._started = asyncio.Lock()  # children are applied concurrently: discover once
        # discovery cached per client, never a file another process (or cluster) wrote
        self._cache = os.path.join(tempfile.gettempdir(), f"rlfleet-discovery-{os.getpid()}-{id(self)}.json")

    async def _dyn(self) -> DynamicClient:
        async with self._started:
            if self._dynamic is None:
                # kopf's TLS context (CA, client certificate) instead of the library's own from a Configuration
                rest = self.client.rest_client
                await rest.pool_manager.close()
                rest.pool_manager = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=32, ssl=self._ssl),
                    trust_env=True,
                    read_bufsize=2**21,
                )
                self._dynamic = await DynamicClient(self.client, cache_file=self._cache)
        return self._dynamic

    async def _call(self, method: str, resource: Any, **arguments: Any) -> Any:
        """The API's JSON of one dynamic-client request (`method`: get, create, patch, ...) on `resource`,
        under the operator's request timeout; KubeError if it failed."""
        request = getattr(await self._dyn(), method)
        return await _result(
            request(resource, serialize=False, _request_timeout=REQUEST_TIMEOUT_SECONDS, **arguments)
        )

    async def _resource(self, api_version: str, kind: str, subresource: str | None = None) -> Any:
        dyn = await self._dyn()
        try:
            resource = await dyn.resources.get(api_version=api_version, kind=kind)
        except ResourceNotFoundError:
            raise KubeError(
                404, f"kind {api_version}/{kind} is not served by the API server", "NotFound"
            ) from None
        return resource.subresources[subresource] if subresource else resource

    async def close(self) -> None:
        await self.client.close()
        with contextlib.suppress(OSError):
            os.remove(self._cache)

    async def apply(
        self,
        body: Mapping[str, Any],
        *,
        field_manager: str = FIELD_MANAGER,
        subresource: str | None = None,
        force: bool = True,
    ) -> dict[str, Any]:
        """Server-side apply of `body` (as `field_manager`, taking over conflicting fields when forced)."""
        meta = body["metadata"]
        resource = await self._resource(body["apiVersion"], body["kind"], subresource)
        return await self._call(
            "server_side_apply",
            resource,
            body=dict(body),
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=field_manager,
            force_conflicts=force,
            query_params=[("fieldValidation", "Strict")],
        )

    async def patch_status(
        self, obj: Mapping[str, Any], status: Mapping[str, Any], field_manager: str = STATUS_FIELD_MANAGER
    ) -> dict[str, Any] | None:
        """Server-side apply of `status` on the object's status subresource; None if the object is gone."""
        return await _none_on(
            404, self.apply(status_apply_body(obj, status), field_manager=field_manager, subresource="status")
        )

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any] | None:
        """A JSON merge patch of the object (or its subresource); None if the object is gone. For a field
        the operator changes on its own (a scale, the precision autopilot's override), not a child's
        desired state (that is `apply`)."""
        resource = await self._resource(api_version, kind, subresource)
        merge_patch = "application/merge-patch+json"
        return await _none_on(
            404,
            self._call(
                "patch", resource, body=dict(body), name=name, namespace=namespace, content_type=merge_patch
            ),
        )

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        """Set spec.replicas through the object's scale subresource (a merge patch of /scale, as `kubectl
        scale` does); None if the object is gone."""
        return await self.patch(api_version, kind, namespace, name, {"spec": {"replicas": replicas}}, "scale")

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        """The object (namespace None: a cluster-scoped one); None if it does not exist."""
        resource = await self._resource(api_version, kind)
        return await _none_on(404, self._call("get", resource, name=name, namespace=namespace))

    async def list(self, api_version: str, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        """The objects of one kind in one namespace (None: in every namespace)."""
        resource = await self._resource(api_version, kind)
        listed = await self._call("get", resource, namespace=namespace)
        return list(listed.get("items") or [])

    async def create(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create; None if it already exists (for objects created once, e.g. a generated Secret)."""
        resource = await self._resource(body["apiVersion"], body["kind"])
        namespace = body["metadata"].get("namespace")
        return await _none_on(409, self._call("create", resource, body=dict(body), namespace=namespace))

    async def delete(
        self, api_version: str, kind: str, namespace: str, name: str, propagation: str = "Background"
    ) -> bool:
        """Delete; False if it was already gone."""
        resource = await self._resource(api_version, kind)
        # the API answers a delete with the object or a Status, never an empty body: None is the 404
        deleted = await _none_on(
            404,
            self._call("delete", resource, name=name, namespace=namespace, propagation_policy=propagation),
        )
        return deleted is not None


# --- one client per event loop, built from the credentials kopf logged in with -----------------------
_connection: kopf.ConnectionInfo | None = None
_apis: dict[asyncio.AbstractEventLoop, KubeApi] = {}


def set_connection(info: kopf.ConnectionInfo) -> None:
    global _connection
    _connection = info


def connected() -> bool:
    """Whether the kopf login handler has run (`api()` works)."""
    return _connection is not None


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
