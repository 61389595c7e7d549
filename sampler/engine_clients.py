"""Clients of an engine's weight-update API (SGLang 0.5.23 HTTP): how a verified directory becomes the
weights an engine serves.

- `DiskEngine` (the sidecar's mode): `POST /update_weights_from_disk {model_path, weight_version,
  flush_cache, abort_all_requests}` with the next version of the SAME view (SGLang loads it into the
  launch-time model with its launch-time quantization method, never re-quantizing; it rolls back on
  failure);
- `PushEngine`: `/init_weights_update_group` once, then per version `/pause_generation {mode: retract}`
  -> `/begin_weight_update` -> n x `/update_weights_from_distributed {names, dtypes, shapes,
  group_name, weight_version, load_format}` -> `/end_weight_update` -> `/continue_generation`
  (`continue` is always sent once `pause` was, so a failed push leaves the engine serving). The
  tensor bytes travel over the NCCL group (rank 0 = this sidecar, `sender` hook); that data plane
  needs GPUs and is not exercised on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from rlfleet.channel import Manifest

# safetensors dtype -> torch dtype name (what SGLang's update_weights_from_distributed expects)
TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "BOOL": "bool",
}


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


Sender = Callable[[int, Path, list[str]], Awaitable[None]]
"""Push data plane: broadcast the named tensors of `model_dir` over the NCCL update group (GPU only)."""


@dataclass
class PushGroup:
    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class PushEngine:
    """Applies a version with the pause / begin / update_weights_from_distributed / end / continue sequence."""

    mode = "push"

    def __init__(
        self,
        client: httpx.AsyncClient,
        group: PushGroup,
        *,
        sender: Sender | None = None,
        bucket_bytes: int = 512 * 1024 * 1024,
        load_format: str | None = None,
    ) -> None:
        self.client = client
        self.group = group
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self._initialized = False

    @staticmethod
    def buckets(manifest: Manifest, view: str, bucket_bytes: int) -> list[list[tuple[str, str, list[int]]]]:
        """Tensors of the view as (name, torch dtype, shape), in buckets of at most ~bucket_bytes."""
        sizes = {
            "BF16": 2,
            "F16": 2,
            "F32": 4,
            "F64": 8,
            "F8_E4M3": 1,
            "F8_E5M2": 1,
            "U8": 1,
            "I8": 1,
            "I16": 2,
            "I32": 4,
            "I64": 8,
            "BOOL": 1,
        }
        out: list[list[tuple[str, str, list[int]]]] = [[]]
        used = 0
        for name, meta in sorted(manifest.views[view].tensors.items()):
            n = sizes.get(meta["dtype"], 4)
            for d in meta["shape"]:
                n *= d
            if out[-1] and used + n > bucket_bytes:
                out.append([])
                used = 0
            out[-1].append(
                (name, TORCH_DTYPES.get(meta["dtype"], meta["dtype"].lower()), list(meta["shape"]))
            )
            used += n
        return [b for b in out if b]

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return _check_response(await self.client.post(path, json=body), path.lstrip("/"))

    async def apply(self, version: int, model_dir: Path, manifest: Manifest, view: str) -> None:
        if not self._initialized:
            await self._post("/init_weights_update_group", asdict(self.group))
            self._initialized = True
        await self._post("/pause_generation", {"mode": "retract"})
        try:
            await self._post("/begin_weight_update", {})
            for bucket in self.buckets(manifest, view, self.bucket_bytes):
                names = [n for n, _, _ in bucket]
                request = self._post(
                    "/update_weights_from_distributed",
                    {
                        "names": names,
                        "dtypes": [d for _, d, _ in bucket],
                        "shapes": [s for _, _, s in bucket],
                        "group_name": self.group.group_name,
                        "weight_version": str(version),
                        "load_format": self.load_format,
                    },
                )
                if self.sender is None:
                    await request
                else:  # the engine's request blocks until it received the broadcast
                    await asyncio.gather(request, self.sender(version, model_dir, names))
            await self._post("/end_weight_update", {})
        finally:
            await self._post("/continue_generation", {})


async def engine_weight_version(client: httpx.AsyncClient) -> int | None:
    """The version the engine reports serving, if it says (best effort: /model_info weight_version)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
        response = await client.get("/model_info", timeout=5.0)
        if response.status_code == 200:
            value = response.json().get("weight_version")
            if value is not None and str(value).isdigit():
                return int(value)
    return None
