"""The routing table's decisions (pure): group order, replica choice by load, versions, health."""

from __future__ import annotations

from rlfleet.router import hashing
from rlfleet.router.table import RoutingTable, VersionConflict

KEYS = [hashing.key_hash(f"s{i}") for i in range(300)]


def table() -> RoutingTable:
    t = RoutingTable()
    t.set_group("a", ["http://a0:1", "http://a1:1", "http://a2:1"], share=1.0)
    t.set_group("b", ["http://b0:1"], share=1.0)
    return t


def test_replica_affinity_holds_until_the_load_gap_exceeds_the_slack() -> None:
    t = table()
    group = t.groups["a"]
    key = KEYS[0]
    own = t.choose_replica(group, key, set(), None, load_slack=2)
    assert t.choose_replica(group, key, set(), None, load_slack=2) is own  # sticky
    own.inflight = 2
    assert t.choose_replica(group, key, set(), None, load_slack=2) is own  # within the slack
    own.inflight = 3
    other = t.choose_replica(group, key, set(), None, load_slack=2)
    assert other is not own and other.inflight == 0
    # Sessions spread over replicas (rendezvous), not all onto one.
    own.inflight = 0
    assert len({t.choose_replica(group, k, set(), None, 2).url for k in KEYS[:60]}) == 3


def test_versions_filter_replicas_and_conflict_when_none_is_fresh() -> None:
    t = table()
    group = t.groups["a"]
    for replica, version in zip(group.replicas.values(), (3, 5, None), strict=True):
        replica.weight_version = version
    picks = {t.choose_replica(group, k, set(), 5, 2).url for k in KEYS[:60]}
    assert picks == {"http://a1:1", "http://a2:1"}  # unknown versions are tried and verified
    group.replicas["http://a2:1"].weight_version = 4
    conflict = t.choose_replica(group, KEYS[0], {"http://a1:1"}, 5, 2)
    assert isinstance(conflict, VersionConflict) and sorted(conflict.served_versions) == [3, 4, 5]


def test_health_marks_and_group_order() -> None:
    t = table()
    for replica in t.groups["b"].replicas.values():
        t.mark_result(replica, False, failure_threshold=2)
        assert replica.healthy  # one soft failure is not enough
        t.mark_result(replica, False, failure_threshold=2)
        assert not replica.healthy
    # b has no healthy replica: every session's first choice is a; b stays as a last resort.
    assert all(t.group_order(k) == ["a", "b"] for k in KEYS)
    group_b = t.groups["b"]
    assert t.choose_replica(group_b, KEYS[0], set(), None, 2, allow_unhealthy=False) is None
    assert t.choose_replica(group_b, KEYS[0], set(), None, 2, allow_unhealthy=True) is not None
    t.mark_result(group_b.replicas["http://b0:1"], True, failure_threshold=2)
    assert {t.group_order(k)[0] for k in KEYS} == {"a", "b"}
    t.mark_result(group_b.replicas["http://b0:1"], False, failure_threshold=5, hard=True)
    assert not group_b.replicas["http://b0:1"].healthy  # a refused connection takes it out at once


def test_replacing_replicas_keeps_what_is_known_about_the_ones_that_stay() -> None:
    t = table()
    kept = t.groups["a"].replicas["http://a1:1"]
    kept.weight_version, kept.healthy = 7, False
    t.set_group("a", ["http://a1:1", "http://a9:1"])
    assert t.groups["a"].replicas["http://a1:1"] is kept
    assert t.groups["a"].share == 1.0 and list(t.groups["a"].replicas) == ["http://a1:1", "http://a9:1"]


def test_effective_shares_and_snapshot() -> None:
    t = table()
    t.set_shares({"a": 3.0, "b": 1.0})
    assert t.effective_shares() == {"a": 0.75, "b": 0.25}
    t.set_group("b", quarantined=True)
    assert t.effective_shares() == {"a": 1.0, "b": 0.0}
    snap = t.snapshot()["groups"]
    assert [g["routable"] for g in snap] == [True, False] and snap[0]["replicas"][0]["healthy"] is True
    assert sum(hashing.pick(k, {"a": 3.0, "b": 1.0}) == "a" for k in KEYS) > 180
