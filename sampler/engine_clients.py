"""Clients of an engine's weight-update API (SGLang 0.5.23 HTTP): how a verified directory becomes the
weights an engine serves.

- `DiskEngine`: `POST /update_weights_from_disk {model_path, weight_version, flush_cache,
  abort_all_requests}` with the next version of the SAME view (SGLang loads it into the launch-time
  model with its launch-time quantization method, never re-quantizing; it rolls back on failure).

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
