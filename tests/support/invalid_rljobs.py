"""tests/api/invalid_rljobs.yaml: invalid variants of examples/rljob.yaml, each a patch of the example and
the message expected (pydantic in tests/api/test_api_models.py, the real kube-apiserver in
tests/operator/test_operator_cluster_validation.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CASES: list[dict[str, Any]] = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "api" / "invalid_rljobs.yaml").read_text()
)


def apply_case(manifest: dict, case: dict) -> dict:
    """A copy of `manifest` with the case's `set` applied: dotted paths, list indices as numbers; with
    `delete: true` the keys are removed instead."""
    out = copy.deepcopy(manifest)
    for dotted, value in case["set"].items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(leaf) if isinstance(node, list) else leaf
        if case.get("delete"):
            del node[key]
        else:
            node[key] = value
    return out
