"""Weighted rendezvous hashing: session key -> member (group or replica). Pure, stateless.

Each (key, member) pair gets a pseudo-random unit value u in (0, 1); the member with the smallest
`-ln(u) / weight` wins. `-ln(u)` is Exp(1), so `-ln(u) / w` is Exp(w) and the winner is member i
with probability exactly `w_i / sum(w)` (the race of exponentials; this is "P-MinHash").

Why rendezvous and not a slot table: the mapping depends only on the current weights, never on the
history of weight updates, so every router replica (and a restarted router) maps a session to the
same group without sharing state. Movement under weight changes:
- scaling all weights by a constant moves nothing;
- changing ONE member's weight from share s to s' moves exactly the sessions the share change
  forces (|s' - s| of them in expectation), and only into (or out of) that member;
- adding a member moves only sessions into it; removing one (weight 0, dead, quarantined) moves only
  its own sessions, each to its deterministic second choice, and they come back when it returns;
- a simultaneous change of several weights moves `1 - J_P(s, s')` of the sessions, where J_P is the
  probability Jaccard index (`sum_i 1 / sum_j max(s_j/s_i, s'_j/s'_i)`); P-MinHash is the optimal
  stateless scheme for that (Moulton & Jiang, 2018), and 1 - J_P <= 2 TV / (1 + TV).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping

_MASK64 = (1 << 64) - 1
_TWO_POW_64 = float(1 << 64)


def key_hash(key: str | bytes) -> int:
    """64-bit hash of a session key (blake2b: stable across processes, unlike `hash()`)."""
    data = key.encode() if isinstance(key, str) else key
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def member_seed(member: str) -> int:
    """64-bit seed of a member name; precompute it once per member."""
    return int.from_bytes(
        hashlib.blake2b(member.encode(), digest_size=8, person=b"rlfleet-rdv").digest(), "little"
    )


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit mixer with full avalanche (cheap pure-int hashing)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def unit_value(key_h: int, seed: int) -> float:
    """The pair's uniform value in the open interval (0, 1)."""
    return (_mix64(key_h ^ seed) + 0.5) / _TWO_POW_64


def race_time(key_h: int, seed: int, weight: float) -> float:
    """Exp(weight) arrival time of a member for a key; the smallest one wins. inf for weight <= 0."""
    if weight <= 0.0:
        return math.inf
    return -math.log(unit_value(key_h, seed)) / weight


def rank(
    key: str | bytes | int, weights: Mapping[str, float], seeds: Mapping[str, int] | None = None
) -> list[str]:
    """Members with weight > 0, best first (the fallback order when the first choice is down)."""
    key_h = key if isinstance(key, int) else key_hash(key)
    scored: list[tuple[float, str]] = []
    for member, weight in weights.items():
        if weight > 0.0:
            seed = seeds[member] if seeds is not None else member_seed(member)
            scored.append((race_time(key_h, seed, weight), member))
    scored.sort()
    return [member for _, member in scored]


def pick(
    key: str | bytes | int, weights: Mapping[str, float], seeds: Mapping[str, int] | None = None
) -> str | None:
    """The winning member for a key, or None when no member has a positive weight."""
    key_h = key if isinstance(key, int) else key_hash(key)
    best: str | None = None
    best_time = math.inf
    for member, weight in weights.items():
        if weight > 0.0:
            seed = seeds[member] if seeds is not None else member_seed(member)
            t = race_time(key_h, seed, weight)
            if t < best_time:
                best, best_time = member, t
    return best


def normalise(weights: Mapping[str, float]) -> dict[str, float]:
    """Shares summing to 1 over members with positive weight (others 0). All-zero stays all-zero."""
    total = sum(w for w in weights.values() if w > 0.0)
    if total <= 0.0:
        return {m: 0.0 for m in weights}
    return {m: (w / total if w > 0.0 else 0.0) for m, w in weights.items()}


def total_variation(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """TV distance between two share vectors (normalised first): the fraction that MUST move."""
    na, nb = normalise(a), normalise(b)
    members: Iterable[str] = set(na) | set(nb)
    return 0.5 * sum(abs(na.get(m, 0.0) - nb.get(m, 0.0)) for m in members)


def expected_moved_fraction(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """1 - J_P(a, b): the exact expected fraction of keys this hashing moves from weights a to b."""
    na, nb = normalise(a), normalise(b)
    members = sorted(set(na) | set(nb))
    jaccard = 0.0
    for i in members:
        ai, bi = na.get(i, 0.0), nb.get(i, 0.0)
        if ai <= 0.0 or bi <= 0.0:
            continue
        denominator = sum(max(na.get(j, 0.0) / ai, nb.get(j, 0.0) / bi) for j in members)
        jaccard += 1.0 / denominator
    return 1.0 - jaccard
