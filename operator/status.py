"""PURE status computation: everything the operator observed -> the WHOLE status of an object. One
module per kind (`group_status.py`, `job_status.py`, `channel_status.py`); here what they share: the
conditions, the message limits and the change gate (`status_changed`).

One writer per resource (docs/architecture.md, "Operator"): the reconcile pipeline observes (kopf
indexes of the objects and of the operator's pods, plus the rebalance tick's scrapes held in memory),
calls these functions, and applies the result once under one field manager (`STATUS_FIELD_MANAGER`).
So every status field, the rebalancer's shares and the trainer's step included, comes out of here; a
field the pipeline has not observed yet (after a restart, before the first rebalance) is carried over
from the observed status, never dropped.

Conventions (KubeRay / LWS): a phase plus Ready / Progressing / Degraded conditions, each with
observedGeneration, a CamelCase reason and a message; lastTransitionTime changes only when a
condition's status changes; the pipeline writes status only when `status_changed` says so. Degraded
says WHY and names the object: the scheduler's message for an unschedulable pod or a missing PVC, the
kubelet's reason for a missing Secret, an image that does not pull or a crash loop (`pods.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

Manifest = dict[str, Any]
# A condition's message and an RLJob's status.message stay short: `kubectl describe` and Argo CD show them
# whole, and one reason repeated per group and per condition made a 10 KB status (identical reasons of
# groups are merged instead, `_merge_groups`).
MESSAGE_LIMIT = 1024


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def clip(text: str, limit: int = MESSAGE_LIMIT) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def condition(type_: str, ok: bool, reason: str, message: str, generation: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": clip(message),
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def merge_conditions(
    old: list[dict[str, Any]] | None, new: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """`new` conditions with lastTransitionTime kept from `old` when the status did not change."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = previous.get(c["type"])
        ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == c["status"] else None
        out.append({**c, "lastTransitionTime": ltt or now})
    return out


def nested(d: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def present(fields: Mapping[str, Any]) -> dict[str, Any]:
    """`fields` without the unknown ones (None): the status schemas have no nulls."""
    return {k: v for k, v in fields.items() if v is not None}


def object_condition(obj: Manifest | None, type_: str) -> dict[str, Any] | None:
    """The condition `type_` of an object's status (None: it has none)."""
    for c in nested(obj, "status", "conditions", default=[]) or []:
        if c.get("type") == type_:
            return c
    return None


def _strip_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_times(v) for k, v in value.items() if k != "lastTransitionTime"}
    if isinstance(value, list):
        return [_strip_times(v) for v in value]
    return value


def status_changed(observed: Manifest | None, desired: dict[str, Any]) -> bool:
    """True when any operator-owned field differs from the observed status (transition times ignored;
    conditions owned by others, e.g. CollapseRisk on a SamplerGroup, are not compared)."""
    observed = observed or {}
    for key, value in desired.items():
        have = observed.get(key)
        if key == "conditions":
            mine = {c["type"] for c in value}
            have = [c for c in have or [] if c.get("type") in mine]
            if _strip_times(sorted(have, key=lambda c: c["type"])) != _strip_times(
                sorted(value, key=lambda c: c["type"])
            ):
                return True
        elif _strip_times(have) != _strip_times(value):
            return True
    return False
