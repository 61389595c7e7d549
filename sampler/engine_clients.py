"""Clients of an engine's weight-update API (SGLang 0.5.23 HTTP): how a verified directory becomes the
weights an engine serves.

- `DiskEngine`: `POST /update_weights_from_disk {model_path, weight_version, flush_cache,
  abort_all_requests}` with the next version of the SAME view (SGLang loads it into the launch-time
  model with its launch-time quantization method, never re-quantizing; it rolls back on failure).

- `LoraEngine` (a job with `trainer.lora`, docs/weights.md "LoRA"): the engine serves its frozen base view
  and each version is an adapter: `POST /load_lora_adapter {lora_name: "v<N>", lora_path}`, then
  `/update_weight_version` N (without aborting requests: /model_info and responses then say N, which the
  router names in requests), then `/unload_lora_adapter` of every adapter older than the one before
  (SGLang unloads it once the requests running on it finished). Which adapters the engine holds is its
  `/v1/models` (SGLang lists each loaded adapter with its base as `parent`).

There is no NCCL push client: SGLang's `/update_weights_from_distributed` needs a sender holding the
tensors on a GPU in the same process group, which no rlfleet component is (docs/weights.md, "Sync
sidecar").
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx

from rlfleet.channel import Manifest
from rlfleet.lora import adapter_name, adapter_version


class EngineError(Exception):
    """The engine refused or failed an update (it keeps serving its previous weights)."""


def _check_response(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = {"message": response.text[:200]}
    if not isinstance(body, dict):
        body = {"message": str(body)[:200]}
    if response.status_code != 200 or body.get("success") is False:
        raise EngineError(f"{what}: HTTP {response.status_code}: {body.get('message', '')}".strip())
    return body


class DiskEngine:
    """Applies a verified local directory with `/update_weights_from_disk`."""

    mode = "disk"

    def __init__(
        self, client: httpx.AsyncClient, *, flush_cache: bool = True, abort_all_requests: bool = False
    ) -> None:
        self.client = client
        self.flush_cache = flush_cache
        self.abort_all_requests = abort_all_requests

    async def apply(self, version: int, model_dir: Path, manifest: Manifest, view: str) -> None:
        body = {
            "model_path": str(model_dir),
            "weight_version": str(version),
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
        }
        _check_response(
            await self.client.post("/update_weights_from_disk", json=body), "update_weights_from_disk"
        )


async def engine_weight_version(client: httpx.AsyncClient) -> int | None:
    """The version the engine reports serving, if it says (best effort: /model_info weight_version)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
        response = await client.get("/model_info", timeout=5.0)
        if response.status_code == 200:
            value = response.json().get("weight_version")
            if value is not None and str(value).isdigit():
                return int(value)
    return None


class LoraEngine:
    """Applies a verified adapter directory (the `lora` view of a version) to an engine serving its base."""

    mode = "lora"

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def apply(self, version: int, model_dir: Path, manifest: Manifest, view: str) -> None:
        name = adapter_name(version)
        loaded = await self.loaded_adapters()
        if version not in loaded:  # a restarted sidecar may find it loaded already (a name loads once)
            body = {"lora_name": name, "lora_path": str(model_dir)}
            _check_response(await self.client.post("/load_lora_adapter", json=body), "load_lora_adapter")
        # Requests keep running: the version only tells /model_info and new answers which adapter is newest.
        update = {"new_version": str(version), "abort_all_requests": False}
        _check_response(
            await self.client.post("/update_weight_version", json=update), "update_weight_version"
        )
        previous = max((v for v in loaded if v < version), default=None)
        for old in sorted(v for v in loaded if v < version and v != previous):
            # Answers once the requests running on it finished (SGLang's LoRARegistry.wait_for_unload).
            unload = {"lora_name": adapter_name(old)}
            _check_response(
                await self.client.post("/unload_lora_adapter", json=unload), "unload_lora_adapter"
            )

    async def loaded_adapters(self) -> set[int]:
        """Versions of the rlfleet adapters the engine holds (its /v1/models entries with a parent)."""
        response = await self.client.get("/v1/models", timeout=10.0)
        body = _check_response(response, "/v1/models")
        versions = set()
        for card in body.get("data") or []:
            if isinstance(card, dict) and card.get("parent") and isinstance(card.get("id"), str):
                version = adapter_version(card["id"])
                if version is not None:
                    versions.add(version)
        return versions

    async def serving(self) -> int | None:
        """The newest adapter the engine holds (None: none, e.g. a restarted engine)."""
        loaded = await self.loaded_adapters()
        return max(loaded) if loaded else None
