"""The routing table: groups, shares, replicas and what the router knows about them. No I/O.

Decisions made here (all pure given the table's state):
- session -> group: weighted rendezvous over the groups that can take traffic (share > 0, not
  quarantined, at least one healthy replica); the rest of the ranking is the fallback order, so when
  a group dies its sessions move to their own second choice and come back when it returns;
- group -> replica: rendezvous over the group's replicas (prefix-cache affinity) unless that replica
  carries more than `load_slack` requests in flight above the least loaded one, then the least
  loaded; replicas known to serve an older weight version than the request's minimum (or, slime's
  exact_version, another version than the one asked for) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfleet.router import hashing


@dataclass
class Replica:
    url: str
    group: str
    seed: int
    healthy: bool = True
    inflight: int = 0
    # Served weight version: from /model_info (health checks) or a response's meta_info; None = unknown.
    weight_version: int | None = None
    consecutive_failures: int = 0
    requests: int = 0
    failures: int = 0
    model_info_path: str | None = "/model_info"  # None once the upstream showed it has none

    def observe_version(self, version: int | None) -> None:
        # Versions are monotonic per channel; never go back on a late or reordered observation.
        if version is not None and (self.weight_version is None or version > self.weight_version):
            self.weight_version = version

    def snapshot(self) -> dict[str, object]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "weightVersion": self.weight_version,
            "requests": self.requests,
            "failures": self.failures,
            "consecutiveFailures": self.consecutive_failures,
        }


@dataclass
class Group:
    name: str
    share: float
    seed: int
    replicas: dict[str, Replica] = field(default_factory=dict)
    quarantined: bool = False

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def routable(self) -> bool:
        return self.share > 0.0 and not self.quarantined and any(r.healthy for r in self.replicas.values())


def serves(version: int | None, min_version: int | None, exact_version: int | None = None) -> bool:
    """Whether a replica at weight `version` may take a request asking for >= `min_version` and (slime's
    `weight_version.exact_version`) exactly `exact_version`; an unknown version may (checked later)."""
    if version is None:
        return True
    if min_version is not None and version < min_version:
        return False
    return exact_version is None or version == exact_version


@dataclass(frozen=True)
class VersionConflict:
    """No replica of the session's group serves the requested weight version (minimum or exact) yet."""

    group: str
    min_version: int
    served_versions: tuple[int | None, ...]


class RoutingTable:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self._epoch = 0
        self._cache_epoch = -1
        self._routable: dict[str, float] = {}
        self._fallback: dict[str, float] = {}
        self._seeds: dict[str, int] = {}

    # --- mutation (config and membership, admin API, health checks) ---------------------------

    def changed(self) -> None:
        """Call after anything that can change which groups are routable."""
        self._epoch += 1

    def set_group(
        self,
        name: str,
        replicas: list[str] | None = None,
        share: float | None = None,
        quarantined: bool | None = None,
    ) -> Group:
        group = self.groups.get(name)
        if group is None:
            group = Group(name=name, share=1.0 if share is None else share, seed=hashing.member_seed(name))
            self.groups[name] = group
        if share is not None:
            group.share = share
        if quarantined is not None:
            group.quarantined = quarantined
        if replicas is not None:
            # Keep what we know (health, version, in-flight count) about replicas that stay.
            kept = {url: group.replicas[url] for url in replicas if url in group.replicas}
            group.replicas = {
                url: kept.get(url) or Replica(url=url, group=name, seed=hashing.member_seed(url))
                for url in replicas
            }
        self.changed()
        return group

    def set_shares(self, shares: dict[str, float]) -> None:
        unknown = sorted(set(shares) - set(self.groups))
        if unknown:
            raise KeyError(f"unknown group(s): {', '.join(unknown)}")
        for name, share in shares.items():
            self.groups[name].share = share
        self.changed()

    def mark_result(self, replica: Replica, ok: bool, failure_threshold: int, hard: bool = False) -> None:
        """Record a health observation. `hard`: the failure proves the replica is down (refused)."""
        if ok:
            replica.consecutive_failures = 0
            if not replica.healthy:
                replica.healthy = True
                self.changed()
            return
        replica.consecutive_failures += 1
        if replica.healthy and (hard or replica.consecutive_failures >= failure_threshold):
            replica.healthy = False
            self.changed()

    # --- decisions ------------------------------------------------------------------------------

    def _refresh(self) -> None:
        if self._cache_epoch == self._epoch:
            return
        self._routable = {g.name: g.share for g in self.groups.values() if g.routable()}
        # Last resort when nothing is known-healthy: groups whose replicas all look down (health
        # information can be stale; trying costs a refused connection, losing the request costs more).
        self._fallback = {
            g.name: g.share
            for g in self.groups.values()
            if g.share > 0.0 and not g.quarantined and g.replicas and g.name not in self._routable
        }
        self._seeds = {g.name: g.seed for g in self.groups.values()}
        self._cache_epoch = self._epoch

    def group_order(self, key_h: int) -> list[str]:
        """Groups to try for a session, best first (first = the sticky group)."""
        self._refresh()
        order = hashing.rank(key_h, self._routable, self._seeds)
        if self._fallback:
            order += hashing.rank(key_h, self._fallback, self._seeds)
        return order

    def effective_shares(self) -> dict[str, float]:
        """The share of new sessions each group gets right now (normalised over routable groups)."""
        self._refresh()
        shares = hashing.normalise(self._routable)
        return {name: shares.get(name, 0.0) for name in self.groups}

    def choose_replica(
        self,
        group: Group,
        key_h: int,
        exclude: set[str],
        min_version: int | None,
        load_slack: int,
        allow_unhealthy: bool = True,
        exact_version: int | None = None,
    ) -> Replica | VersionConflict | None:
        """The replica to try next in a group; None when the group has nothing left to try.
        `allow_unhealthy`: as a last resort, try replicas marked down (they may be back before the
        next health check); the router allows it only when no other group is left to try, because
        a dead pod's address can take the whole connect timeout to fail."""
        candidates = [r for r in group.replicas.values() if r.healthy and r.url not in exclude]
        if not candidates and allow_unhealthy:
            candidates = [r for r in group.replicas.values() if r.url not in exclude]
        if not candidates:
            return None
        if min_version is not None or exact_version is not None:
            # Unknown versions are tried (and verified on the response's meta_info).
            fresh = [r for r in candidates if serves(r.weight_version, min_version, exact_version)]
            if not fresh:
                return VersionConflict(
                    group=group.name,
                    min_version=exact_version if exact_version is not None else min_version or 0,
                    served_versions=tuple(r.weight_version for r in group.replicas.values()),
                )
            candidates = fresh
        if len(candidates) == 1:
            return candidates[0]
        preferred = min(candidates, key=lambda r: hashing.race_time(key_h, r.seed, 1.0))
        least = min(r.inflight for r in candidates)
        if preferred.inflight <= least + load_slack:
            return preferred
        loaded = [r for r in candidates if r.inflight == least]
        return min(loaded, key=lambda r: hashing.race_time(key_h, r.seed, 1.0))

    def snapshot(self) -> dict[str, object]:
        effective = self.effective_shares()
        return {
            "groups": [
                {
                    "name": g.name,
                    "share": g.share,
                    "effectiveShare": effective.get(g.name, 0.0),
                    "quarantined": g.quarantined,
                    "routable": g.routable(),
                    "replicas": [r.snapshot() for r in g.replicas.values()],
                }
                for g in self.groups.values()
            ]
        }
