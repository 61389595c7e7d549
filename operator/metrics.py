"""The operator's own metrics (exported by `rlfleet operator run --metrics-port`; docs/operations.md)."""

from __future__ import annotations

from typing import Any

try:
    from prometheus_client import Counter, Histogram

    RECONCILES = Counter("rlfleet_operator_reconciles_total", "Reconciles", ["kind", "result"])
    RECONCILE_SECONDS = Histogram("rlfleet_operator_reconcile_seconds", "Reconcile duration", ["kind"])
    STATUS_WRITES = Counter(
        "rlfleet_operator_status_writes_total", "Status writes (only on change)", ["kind"]
    )
    SUBSCRIBER_REMOVALS = Counter(
        "rlfleet_operator_subscriber_reports_removed_total",
        "Weight-channel subscriber reports of gone replicas the operator deleted from the store "
        "(result: removed, or error: a delete the store refused)",
        ["result"],
    )
except ImportError:  # pragma: no cover - prometheus_client is in the operator extra
    RECONCILES = RECONCILE_SECONDS = STATUS_WRITES = SUBSCRIBER_REMOVALS = None  # type: ignore[assignment]


def count(metric: Any, *labels: str) -> None:
    if metric is not None:
        metric.labels(*labels).inc()
