"""Prometheus metrics of the router (one registry per router, so tests can run several).

Per-request counters are cached label children (a `.labels()` lookup per request would cost more
than the routing decision). Table state (shares, healthy replicas, versions, in-flight) is read at
scrape time by a collector instead of being updated on every change.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rlfleet.router.table import RoutingTable

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)


class _TableCollector(Collector):
    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        share = GaugeMetricFamily(
            "rlfleet_router_group_share", "configured share (weight) of a group", labels=["group"]
        )
        effective = GaugeMetricFamily(
            "rlfleet_router_group_effective_share",
            "fraction of new sessions the group gets now (0 when quarantined or down)",
            labels=["group"],
        )
        healthy = GaugeMetricFamily(
            "rlfleet_router_group_healthy_replicas", "healthy replicas of a group", labels=["group"]
        )
        inflight = GaugeMetricFamily(
            "rlfleet_router_replica_inflight", "requests in flight to a replica", labels=["group", "replica"]
        )
        version = GaugeMetricFamily(
            "rlfleet_router_replica_weight_version",
            "weight version a replica serves",
            labels=["group", "replica"],
        )
        shares = self._table.effective_shares()
        for group in self._table.groups.values():
            share.add_metric([group.name], group.share)
            effective.add_metric([group.name], shares.get(group.name, 0.0))
            healthy.add_metric([group.name], len(group.healthy_replicas()))
            for replica in group.replicas.values():
                inflight.add_metric([group.name, replica.url], replica.inflight)
                if replica.weight_version is not None:
                    version.add_metric([group.name, replica.url], replica.weight_version)
        yield from (share, effective, healthy, inflight, version)


class RouterMetrics:
    def __init__(self, table: RoutingTable) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rlfleet_router_requests",
            "requests answered, by group and HTTP status",
            ["group", "code"],
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "rlfleet_router_generated_tokens", "completion tokens returned", ["group"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "rlfleet_router_prompt_tokens", "prompt tokens sent", ["group"], registry=self.registry
        )
        self.latency = Histogram(
            "rlfleet_router_request_seconds",
            "end-to-end latency seen by the router (all attempts)",
            ["group"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "rlfleet_router_upstream_errors",
            "failed attempts, by group and kind (connect, disconnect, timeout, hung, http_5xx, version_conflict, adapter_not_loaded)",
            ["group", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            "rlfleet_router_retries",
            "attempts after the first one, by the group retried on",
            ["group"],
            registry=self.registry,
        )
        self.refused = Counter(
            "rlfleet_router_refused_requests",
            "requests answered before routing, by reason (body_too_large, body_budget, body_timeout, deep_json, adapter_body)",
            ["reason"],
            registry=self.registry,
        )
        self.refused_connections = Counter(
            "rlfleet_router_refused_connections",
            "client connections closed on accept, by reason (source: its address is at "
            "maxClientConnectionsPerSource; total: at maxClientConnections with none idle to close)",
            ["reason"],
            registry=self.registry,
        )
        self.closed_idle_connections = Counter(
            "rlfleet_router_closed_idle_connections",
            "idle client connections (waiting for a request header) closed to admit a new one at maxClientConnections",
            registry=self.registry,
        )
        self.registry.register(_TableCollector(table))
        self._children: dict[tuple[str, ...], object] = {}

    def _child(self, metric, *labels: str):
        key = (metric._name, *labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    def answered(self, group: str, code: int, seconds: float, completion: int, prompt: int) -> None:
        self._child(self.requests, group, str(code)).inc()
        self._child(self.latency, group).observe(seconds)
        if completion:
            self._child(self.generated_tokens, group).inc(completion)
        if prompt:
            self._child(self.prompt_tokens, group).inc(prompt)

    def error(self, group: str, kind: str) -> None:
        self._child(self.errors, group, kind).inc()

    def retry(self, group: str) -> None:
        self._child(self.retries, group).inc()

    def refuse(self, reason: str) -> None:
        self._child(self.refused, reason).inc()

    def refuse_connection(self, reason: str) -> None:
        self._child(self.refused_connections, reason).inc()
