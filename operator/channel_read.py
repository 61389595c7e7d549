"""One read of a WeightChannel's store, for its status (the WeightChannel pipeline runs it in a thread):
the pointer, the manifest and the subscriber reports, the reports of gone replicas removed, and the
published model's head counts. Blocking, no kopf: docs/weights.md "Subscriber reports".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rlfleet.api import StoreSpec
from rlfleet.operator.model_shape import CONFIG_FILE, model_shape


@dataclass(frozen=True)
class ChannelRead:
    """What one read of a channel's store gave: its status (None: unreadable, `error` says why), the
    reports of gone replicas deleted meanwhile, and how many deletes the store refused (and why)."""

    status: Any | None
    error: str | None = None
    removed: tuple[Any, ...] = ()
    removal_failures: int = 0
    removal_error: str | None = None
    model: dict[str, Any] | None = None  # model_shape.model_shape of a published config.json, when read now


def read_channel(
    spec: Mapping[str, Any],
    live_replicas: Mapping[str, frozenset[str]] | None = None,
    now: datetime | None = None,
    want_model: bool = False,
) -> ChannelRead:
    """Read a channel's status (groups from reports not older than SUBSCRIBER_STALE_AFTER_SECONDS) and,
    given the live pods of each sampler group, delete the reports `subscribers_to_remove` picks (each
    only if not rewritten since it was read); with `want_model`, the published model's head counts from a
    view's config.json (`model_shape`). Blocking: run in a thread."""
    try:
        from rlfleet.channel import SUBSCRIBER_STALE_AFTER_SECONDS, read_channel_status
        from rlfleet.store import StoreError, store_from_spec
    except ImportError as exc:  # the weights engineer's modules are not installed
        return ChannelRead(None, f"channel reader unavailable ({exc})")
    now = now or datetime.now(UTC)
    try:
        store = store_from_spec(StoreSpec.model_validate(spec["store"]))
        try:
            status = read_channel_status(store, stale_after_seconds=SUBSCRIBER_STALE_AFTER_SECONDS, now=now)
            removed: list[Any] = []
            failures, removal_error = 0, None
            if live_replicas is not None:
                removed, failures, removal_error = _remove_gone_subscribers(store, status, live_replicas, now)
            model = None
            if want_model and status.latest_version is not None:
                model = _published_model(store, status.latest_version)
            return ChannelRead(status, None, tuple(removed), failures, removal_error, model)
        finally:
            close = getattr(store, "close", None)
            if close:
                close()
    except StoreError as exc:
        return ChannelRead(None, str(exc))
    except (OSError, ValueError) as exc:
        return ChannelRead(None, f"{type(exc).__name__}: {exc}")


def _remove_gone_subscribers(
    store: Any, status: Any, live_replicas: Mapping[str, frozenset[str]], now: datetime
) -> tuple[list[Any], int, str | None]:
    """Delete the reports `subscribers_to_remove` picks, each only if not rewritten since it was read:
    (the removed reports, how many deletes the store refused, the last refusal)."""
    from rlfleet.channel import WeightChannel, subscribers_to_remove
    from rlfleet.store import StoreError

    removed: list[Any] = []
    failures, removal_error = 0, None
    channel = WeightChannel(store, publisher_id="operator")
    for report in subscribers_to_remove(status.subscribers, live_replicas, now):
        try:
            judged = report.updated_at  # deleted only if not rewritten since it was read
            if channel.remove_subscriber(report.group, report.replica, if_updated_at=judged):
                removed.append(report)
        except (StoreError, OSError) as exc:  # e.g. a read-only mount: the next read retries
            failures, removal_error = failures + 1, f"{type(exc).__name__}: {exc}"
    return removed, failures, removal_error


def _published_model(store: Any, version: int) -> dict[str, Any] | None:
    """model_shape of the first view's config.json in the version's manifest, or for a LoRA version (only
    the adapter) in the version holding its first base view (None: no config.json, or one that is not an
    object)."""
    from rlfleet.channel import WeightChannel, lora_bases, manifest_key

    channel = WeightChannel(store, publisher_id="operator")
    manifest = channel.manifest(version)
    bases = sorted(set(lora_bases(manifest).values()) - {version})
    for held in [manifest, *(channel.manifest(v) for v in bases[:1])]:
        folder = manifest_key(held.version).rsplit("/", 1)[0]  # the version's folder in the store
        for view, files in sorted(held.views.items()):
            if CONFIG_FILE in files.files:
                config = json.loads(store.get(f"{folder}/{view}/{CONFIG_FILE}"))
                return model_shape(config, version) if isinstance(config, dict) else None
    return None
