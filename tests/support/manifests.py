"""RLJob manifests as the user writes them (plain dicts), for the tests that build their own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

API = "rlfleet.dev/v1alpha1"


def rljob(
    name: str, sampler_groups: Iterable[Mapping[str, Any]], namespace: str | None = None, **spec: Any
) -> dict[str, Any]:
    """An RLJob of model m at /m with its channel on the filesystem at /w; `spec` adds or replaces
    top-level fields of its spec."""
    return {
        "apiVersion": API,
        "kind": "RLJob",
        "metadata": {"name": name} | ({"namespace": namespace} if namespace else {}),
        "spec": {
            "model": {"name": "m", "path": "/m"},
            "samplerGroups": [dict(group) for group in sampler_groups],
            "weightChannel": {"store": {"type": "filesystem", "path": "/w"}},
            **spec,
        },
    }
