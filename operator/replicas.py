"""Who writes a SamplerGroup's spec.replicas, the way an HPA-scaled Deployment's are written: the operator's
apply sets them when it creates the group, and after that the scale subresource owns them (the decisions'
replicas through /scale, a user's `kubectl scale` alike; docs/architecture.md). The RLJob's own
`samplerGroups[].replicas` reaches an existing group only when it changes (decide.py
`replicas_changed_in_rljob`).

Server-side apply deletes a field its manager drops from the applied configuration unless another manager
owns it too. So before the operator's first apply without replicas (right after it created the group, or
on a group an older operator applied with them), it moves them out of its hands exactly as the Kubernetes
docs' "Transferring ownership" says: an apply of only spec.replicas, at their live value, under a private
field manager (`REPLICAS_HANDOVER_MANAGER`), without force: the two managers share the field, and the
operator's next apply, without it, leaves it to the other. A conflict means someone else has just changed
the field: the operator no longer owns it, nothing to hand over. The next /scale that changes the value
takes the field from the handover manager too, whose entry then disappears.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlfleet.operator import kube
from rlfleet.operator.naming import FIELD_MANAGER, REPLICAS_HANDOVER_MANAGER


def applies_replicas(sg: Mapping[str, Any]) -> bool:
    """Whether the operator's server-side apply (`FIELD_MANAGER`, not its /scale) owns the object's
    spec.replicas, from `metadata.managedFields`."""
    for entry in (sg.get("metadata") or {}).get("managedFields") or []:
        if (
            entry.get("manager") == FIELD_MANAGER
            and entry.get("operation") == "Apply"
            and not entry.get("subresource")
        ):
            if "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
                return True
    return False


def handover_body(sg: Mapping[str, Any]) -> dict[str, Any]:
    """The apply of only spec.replicas, at the object's live value, that the handover manager makes."""
    meta = sg["metadata"]
    return {
        "apiVersion": sg["apiVersion"],
        "kind": sg["kind"],
        "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
        "spec": {"replicas": sg["spec"]["replicas"]},
    }


async def hand_over(sg: Mapping[str, Any]) -> bool:
    """Share the object's spec.replicas with the handover manager when the operator's apply owns them
    (module docstring), so that its next apply can leave them out: True when it did."""
    if not applies_replicas(sg):
        return False
    try:
        await kube.api().apply(handover_body(sg), field_manager=REPLICAS_HANDOVER_MANAGER, force=False)
    except kube.KubeError as exc:
        if exc.status != 409:  # 409: changed by another manager since read, no longer the operator's
            raise
    return True


async def release_after_creation(body: Mapping[str, Any], created: Mapping[str, Any]) -> None:
    """The transfer completed right after the operator's apply created the group from `body` with its
    replicas (`created`: the API's answer): handed over, then `body` applied again without them."""
    if await hand_over(created):
        await kube.api().apply({**body, "spec": {k: v for k, v in body["spec"].items() if k != "replicas"}})
