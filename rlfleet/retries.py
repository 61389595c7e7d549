"""The retry policy of one rollout turn: one owner per concern, stated here and nowhere else.

One turn is one call of the sampler client by the rollout driver (`trainer/rollout/driver.py`): the client
posts `/generate` to the router (`sampler/client.py`), the router forwards it to a sampler replica
(`router/core.py`). Each kind of failure has ONE owner, the layer that can act on it, and no layer
re-retries what the layer below it has already bounded (docs/architecture.md, "Retries"):

| concern | owner | attempts | wait |
| --- | --- | --- | --- |
| a replica fails: its connection is refused, dropped or not made in time, it is found hung (its generation probe gets no answer: never for a request it may still be generating, docs/router.md "Hung replicas"), it answers 502/503/504, or (under `X-Min-Weight-Version`) 409 or an answer from an older version | router | the next replica of the group, then of the session's next group; each replica at most once, at most `ROUTER_MAX_ATTEMPTS` upstream posts per request (`maxAttempts`) | none |
| the router is unavailable: connection refused, dropped or timed out, 502/504 from a proxy, the router's own 503 (it tried every replica it may, or none can take traffic: a group whose Service name cannot be looked up yet has none), 404 (what answers is not a router or engine yet: every one serves /generate) | client | `max_transport_retries` | exponential backoff with jitter |
| the weight version lags: 409 (no replica of the session's group serves `X-Min-Weight-Version` yet) | client | `max_version_retries` | `Retry-After`, capped |
| the sampling-mask cap: a 400 naming `--sampling-mask-max-tokens` | client | `max_shrink_retries`, with a smaller top_k | none |
| the sampling backend: 500 | client | `max_server_error_retries` | none |
| anything else (other 4xx, an unreadable 200) | nobody | final | |
| the router stays unavailable: a turn fails with `TurnFailed("unavailable")` (the client's transport retries spent) | driver | unbounded, one probe group at a time, until the router answers or the trainer stops (its rollout stall limit ends the run) | `OutagePolicy`: exponential backoff with jitter, 1 s doubling to 30 s, x U(0.5, 1); the prompt group is put back, not dropped |
| any other failed turn (`TurnFailed`, or any error of the generate function) | driver | none: the prompt group is dropped and counted | |

The driver's outage rule is a circuit breaker: the first group that fails "unavailable" opens it, no new
prompt is dispatched while it is open, every group that fails "unavailable" is put back (the same
prompt index is dispatched again later, never skipped), and after each wait ONE group probes the
router; a turn that succeeds closes it. Before issue 32 the driver dropped those groups: a 5 s router
outage dropped 16 prompt groups, a dead fleet burned 536 prompts.

Talking to a replica directly (no router: tests, benchmarks), the client's rule for 503 is the same
(SGLang answers 503 when its queue is full).

The bound that follows (`turn_upstream_posts`): a turn makes at most `ClientRetryPolicy.max_posts`
(27) posts to the router, and each costs at most min(`maxAttempts`, replicas) upstream posts, so at
most 27 x 8 = 216 upstream posts for the worst mix of failures, and (1 + 3) x 8 = 32 when every
replica fails. Until issue 26 the driver re-retried a failed turn twice more: 3 x 27 x 8 = 648.
"""

from __future__ import annotations

from dataclasses import dataclass

# Router: per request, across the replicas of the session's group and then of its next groups.
ROUTER_MAX_ATTEMPTS = 8
# A replica answering one of these failed (the router tries the next one); SGLang: 503 = queue full,
# retracted or timed out; 502/504 = a proxy in front of it.
REPLICA_FAILURE_STATUSES = frozenset({502, 503, 504})
# The endpoint the client talks to (the router, or one replica) is unavailable: back off and retry. 404
# too: the client posts only /generate, which every router and engine serves, so a 404 comes from an
# address that does not serve one yet (a fleet still starting) and says nothing about the prompt; it was
# final until issue 39, and a starting dev cluster dropped 413 prompts on it in its first seconds.
UNAVAILABLE_STATUSES = frozenset({404, 502, 503, 504})


def backoff_seconds(attempt: int, initial_s: float, max_s: float, draw: float) -> float:
    """The wait before retry `attempt` (1, 2, ...): initial_s * 2^(attempt-1), capped at max_s, times
    U(0.5, 1) from `draw` in [0, 1) (jitter: clients that failed together do not retry together)."""
    exponent = min(max(attempt - 1, 0), 60)  # 2^60 x any initial wait is past every cap
    return min(max_s, initial_s * 2.0**exponent) * (0.5 + draw / 2)


@dataclass(frozen=True)
class ClientRetryPolicy:
    """What the sampler client retries for one turn, per concern (the table above)."""

    max_transport_retries: int = 3  # router unavailable (or a replica's queue full, talking to it directly)
    backoff_initial_s: float = 0.2  # ... waiting backoff_initial_s * 2^(n-1), capped, x U(0.5, 1)
    backoff_max_s: float = 2.0
    max_version_retries: int = 20  # weight version lag (409), waiting Retry-After
    version_wait_cap_s: float = 2.0  # ... capped at this
    max_shrink_retries: int = 2  # sampling-mask cap (400), each with a smaller top_k
    min_top_k: int = 64  # ... never below this
    max_server_error_retries: int = 1  # sampling backend error (500)

    def backoff(self, attempt: int, draw: float) -> float:
        """The wait before transport retry `attempt` (`backoff_seconds`)."""
        return backoff_seconds(attempt, self.backoff_initial_s, self.backoff_max_s, draw)

    @property
    def max_posts(self) -> int:
        """The most posts of one turn: the first, plus every retry of every concern."""
        return (
            1
            + self.max_transport_retries
            + self.max_version_retries
            + self.max_shrink_retries
            + self.max_server_error_retries
        )


@dataclass(frozen=True)
class OutagePolicy:
    """The rollout driver's wait while the router stays unavailable (the table above): no new prompt
    and one probe group per wait; the wait before probe n is `backoff_seconds(n, ...)`."""

    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def backoff(self, attempt: int, draw: float) -> float:
        return backoff_seconds(attempt, self.backoff_initial_s, self.backoff_max_s, draw)


def turn_upstream_posts(
    policy: ClientRetryPolicy,
    replicas: int,
    max_attempts: int = ROUTER_MAX_ATTEMPTS,
    *,
    every_replica_fails: bool,
) -> int:
    """The most upstream posts (router -> replicas) one turn can cause, with `replicas` replicas that
    may take the session (its group and the fallback groups). `every_replica_fails`: every replica
    answers a replica failure (only the transport retries repeat); else the worst mix of failures."""
    per_router_request = min(max_attempts, replicas)
    client_posts = 1 + policy.max_transport_retries if every_replica_fails else policy.max_posts
    return client_posts * per_router_request
