"""The operator's `KubeApi` (operator/kube.py) faked over a dict, for the handlers' tests without a cluster
(as KubeRay's fake-client tests): the handlers run for real, every write is recorded, reads are answered
from what was written. Install it with `monkeypatch.setattr(rlfleet.operator.kube, "api", lambda: fake)`."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

from rlfleet.operator import kube


class FakeKube:
    """The operator's `KubeApi` surface over a dict: writes are recorded, reads answered from `objects`."""

    def __init__(self, objects: Mapping[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.objects = dict(objects or {})  # (kind, name) -> body
        self.applied: list[dict[str, Any]] = []
        self.statuses: list[tuple[str, str, dict[str, Any]]] = []  # (kind, name, status)
        self.created: list[dict[str, Any]] = []
        self.deleted: list[tuple[str, str]] = []
        self.scaled: list[tuple[str, str, int]] = []  # (kind, name, replicas) through the scale subresource
        self.refuse: dict[str, kube.KubeError] = {}  # kind -> the error `apply` raises for it

    async def apply(self, body: Mapping[str, Any], **_: Any) -> dict[str, Any]:
        await asyncio.sleep(0)  # a real await: concurrent applies interleave as they would
        if body["kind"] in self.refuse:
            raise self.refuse[body["kind"]]
        self.applied.append(copy.deepcopy(dict(body)))
        key = (body["kind"], body["metadata"]["name"])
        merged = copy.deepcopy(dict(body))
        kept = (self.objects.get(key) or {}).get("spec") or {}
        if "replicas" in kept and "replicas" not in merged.get("spec", {"replicas": None}):
            merged["spec"]["replicas"] = kept["replicas"]  # left out of the apply: the scale subresource's
        self.objects[key] = merged
        return copy.deepcopy(merged)

    async def patch_status(self, obj: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any] | None:
        self.statuses.append((obj["kind"], obj["metadata"]["name"], copy.deepcopy(dict(status))))
        return {**obj, "status": dict(status)}

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    async def create(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        key = (body["kind"], body["metadata"]["name"])
        if key in self.objects:
            return None
        self.created.append(copy.deepcopy(dict(body)))
        self.objects[key] = copy.deepcopy(dict(body))
        return dict(body)

    async def scale(
        self, api_version: str, kind: str, namespace: str, name: str, replicas: int
    ) -> dict[str, Any] | None:
        self.scaled.append((kind, name, replicas))
        obj = self.objects.get((kind, name))
        if obj is None:
            return None
        obj.setdefault("spec", {})["replicas"] = replicas
        return copy.deepcopy(obj)

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        self.deleted.append((kind, name))
        return self.objects.pop((kind, name), None) is not None

    def kinds_applied(self) -> list[str]:
        return [b["kind"] for b in self.applied]
