"""PURE status of a WeightChannel (operator/status.py: the conventions): from one read of its store
(operator/channel_read.py) or the error reading it.
"""

from __future__ import annotations

from typing import Any

from rlfleet.operator.status import Manifest, condition, merge_conditions, nested, now_iso, present


def weightchannel_status(
    wc: Manifest,
    channel: Any | None,
    error: str | None,
    now: str | None = None,
    model: Manifest | None = None,
) -> dict[str, Any]:
    """Status of a WeightChannel from `rlfleet.channel.read_channel_status(...)` (or the error reading it)
    and the published model's head counts (`model_shape.model_shape`; None: not read now, the observed
    ones are kept). Per view of the latest version: anchor or delta, stored and complete bytes; and the
    bytes stored for the version over its complete views in % (`kubectl get wc`'s Stored%)."""
    now = now or now_iso()
    generation = nested(wc, "metadata", "generation")
    old = wc.get("status") or {}
    status: dict[str, Any] = {"observedGeneration": generation}
    if model or old.get("model"):
        status["model"] = model or old["model"]
    unreachable: str | None = None
    if channel is None:
        message = f"latest version unknown: {error or 'store not readable from the operator'}"[:4096]
        status.update(phase="Pending", message=message)
        ok, reason = False, "StoreUnreadable"
        unreachable = (
            f"store {store_description(wc)} unreachable from the operator: {error or 'not readable'}"
        )
    else:
        latest = channel.latest_version
        status["artifacts"] = [
            present(
                {
                    "view": a.view,
                    "version": a.version,
                    "uri": a.uri,
                    "sha256": a.sha256,
                    "bytes": a.bytes,
                    "time": a.time,
                    "kind": a.kind,
                    "storedBytes": a.stored_bytes,
                    "base": a.base,
                }
            )
            for a in channel.artifacts
        ][:16]
        if channel.lora_base:
            status["loraBase"] = dict(sorted(channel.lora_base.items()))
        share = channel.stored_share
        if share is not None:
            status["storedPercent"] = round(100.0 * share, 3)
        status["groups"] = [
            present(
                {
                    "group": g.group,
                    "view": g.view,
                    "appliedVersion": g.applied_version,
                    "lag": g.lag,
                    "syncFailures": g.sync_failures or None,
                    "lastError": g.last_error[:512] if g.last_error else None,
                    "replicas": sorted(g.replicas)[:256] or None,
                }
            )
            for g in channel.groups
        ][:64]
        if latest is None:
            status.update(phase="Pending", message="no version published yet")
            ok, reason = False, "NothingPublished"
        else:
            status.update(phase="Ready", latestVersion=latest, message=f"version {latest} published")
            ok, reason = True, "Published"
    status["conditions"] = merge_conditions(
        old.get("conditions"),
        [
            condition("Ready", ok, reason, status["message"], generation),
            condition(
                "Degraded",
                unreachable is not None,
                "StoreUnreachable" if unreachable else "AsExpected",
                (unreachable or "store readable")[:4096],
                generation,
            ),
        ],
        now,
    )
    return status


def store_description(wc: Manifest) -> str:
    """The channel's store in words (names the object a Degraded condition is about)."""
    store = nested(wc, "spec", "store", default={}) or {}
    if store.get("type") == "s3":
        return f"s3://{store.get('bucket', '')}/{store.get('prefix', '')}".rstrip("/")
    return f"{store.get('type', 'filesystem')} {store.get('path', '')}".strip()
