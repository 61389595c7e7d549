"""Async SGLang client: one `/generate` call -> one validated `SampledTurn`.

What it retries, how often and how long it waits is the client's part of the one retry policy of a
turn (`rlfleet/retries.py`, docs/architecture.md "Retries"): the router unavailable (or, talking to a
replica directly, its queue full), the weight version lagging, the sampling-mask cap, the sampling
backend; retrying across replicas is the router's, never the client's. Per status (SGLang 0.5.23's
answers, srt/entrypoints/http_server.py + scheduler aborts; every outcome is counted in `ClientStats`):
- 200: parsed and validated; invalid tokens are flagged in the turn (`valid`, `invalid_reasons`) and
  counted, never dropped silently and never raised. A 200 with `finish_reason {type: abort}` and no
  status (e.g. `abort_all_requests` on a weight reload) is a turn: its tokens are real samples. An
  unreadable body fails the turn (`malformed_response`), final.
- 400 "return_sampling_mask requires top_k=1 ... top_k <= CAP" (support mode): the server's
  --sampling-mask-max-tokens is learnt from the message and the request is resent with top_k = CAP.
- 400 "Sampling support exceeds --sampling-mask-max-tokens=CAP" (ties at the cutoff grew the kept set
  past the cap mid-request): resent with top_k halved (and <= CAP), never below `min_top_k`.
  Both 400 resends count against `max_shrink_retries`, then `bad_request`.
- any other 400 (SGLang's contract gate, a ValueError such as "sampling_logprobs_mode can only be set
  when return_sampling_mask=true", request validation) fails the turn at once (`bad_request`): a
  malformed request does not heal by repetition.
- 500 (ErrorResponse: "The sampling backend selected a token outside its captured sampling support",
  or no captured support): resent `max_server_error_retries` times, then `server_error`.
- 503 (the router: nothing could serve; SGLang: queue full, retracted under memory pressure, timeout
  aborts), 502/504 (a proxy), 404 (not a router or engine yet: both serve /generate), timeouts and
  connection loss: exponential backoff with jitter, at most `max_transport_retries` times, then
  `unavailable` (the rollout driver holds the prompt group: rlfleet/retries.py).
- 409 (our router / reference server: no replica serves `X-Min-Weight-Version` yet): wait Retry-After
  (capped at `version_wait_cap_s`) and retry, up to `max_version_retries` (`version_conflict`).
- any other status fails the turn (`http_<status>`), final.
A failed turn raises `TurnFailed(reason, ...)`; the caller does not retry it (the rollout driver drops
the group).

LoRA (`adapters=True`, a job with `trainer.lora`): every request says `X-RLFleet-Adapter: newest`, so our
router names, in the body it posts, the newest adapter of the replica it chose (groups load a version at
different times); every token's weight version is then the router's `X-RLFleet-Adapter-Version`, the
adapter the whole turn ran on (meta_info's weight_versions spans only say when loads happened). A 200
without that header fails the turn (`malformed_response`): the endpoint is not our router.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from rlfleet.lora import ADAPTER_NEWEST, ADAPTER_REQUEST_HEADER, ADAPTER_VERSION_HEADER
from rlfleet.records import SUPPORT_MODE, SampledTurn
from rlfleet.retries import UNAVAILABLE_STATUSES, ClientRetryPolicy
from rlfleet.sampler.protocol import (
    ProtocolError,
    SamplingConfig,
    build_generate_request,
    dumps_json,
    error_message,
    loads_json,
    mask_cap_error,
    parse_generate_response,
)

SESSION_HEADER = "X-Session-Id"  # our router's session affinity key (also X-SMG-Routing-Key)
MIN_VERSION_HEADER = "X-Min-Weight-Version"
GROUP_HEADER = "X-RLFleet-Group"
REPLICA_HEADER = "X-RLFleet-Replica"


@dataclass
class ClientStats:
    requests: int = 0
    turns: int = 0
    tokens: int = 0
    invalid: int = 0  # tokens flagged invalid (each may fail several checks, see invalid_tokens)
    retries: Counter = field(default_factory=Counter)  # reason -> retries
    failures: Counter = field(default_factory=Counter)  # reason -> failed turns
    invalid_tokens: Counter = field(default_factory=Counter)  # validation reason -> tokens failing that check

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "turns": self.turns,
            "tokens": self.tokens,
            "invalid": self.invalid,
            "retries": dict(self.retries),
            "failures": dict(self.failures),
            "invalid_tokens": dict(self.invalid_tokens),
        }


class TurnFailed(RuntimeError):
    def __init__(self, reason: str, message: str, status: int | None = None, attempts: int = 0) -> None:
        super().__init__(f"{reason}: {message} (status={status}, attempts={attempts})")
        self.reason = reason
        self.status = status
        self.attempts = attempts


@dataclass
class _Tries:
    """One turn's posts so far, by what went wrong (each bounded by ClientRetryPolicy), and its top_k."""

    top_k: int
    attempts: int = 0
    transport: int = 0  # transport errors and unavailable statuses
    server_errors: int = 0
    shrinks: int = 0
    version_waits: int = 0


class SamplerClient:
    """Talks to one SGLang-compatible endpoint (a replica, or our router in front of a fleet).

    `client(session_id, input_ids, params)` has the rollout driver's GenerateFn signature."""

    def __init__(
        self,
        base_url: str,
        *,
        group: str = "",
        replica: str = "",
        timeout_s: float = 120.0,
        policy: ClientRetryPolicy | None = None,
        vocab_size: int | None = None,
        mask_cap: int | None = None,
        http: httpx.AsyncClient | None = None,
        rng: random.Random | None = None,
        api_key: str | None = None,
        adapters: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # LoRA: the router names each request's adapter (its replica's newest) and says which in a header
        self.adapters = adapters
        # the endpoint's bearer key (the router's data-plane key or an engine's --api-key): on every call
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.group = group
        self.replica = replica or self.base_url
        self.policy = policy or ClientRetryPolicy()
        self.vocab_size = vocab_size
        self.mask_cap = mask_cap  # server's --sampling-mask-max-tokens when known
        self.stats = ClientStats()
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))
        self._rng = rng or random.Random()

    async def aclose(self) -> None:
        if self._own_http:
            await self._http.aclose()

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __call__(self, session_id: str, input_ids: list[int], config: SamplingConfig) -> SampledTurn:
        return await self.generate(input_ids, config, session_id=session_id)

    # ------------------------------------------------------------------------------------ generate
    async def generate(
        self,
        input_ids: Sequence[int],
        config: SamplingConfig | Mapping[str, Any],
        *,
        session_id: str | None = None,
        sampling_seed: int | None = None,
        min_weight_version: int | None = None,
    ) -> SampledTurn:
        # the rollout driver passes its run's SamplingConfig; a mapping is for direct calls (tools, tests)
        cfg = config if isinstance(config, SamplingConfig) else SamplingConfig.from_dict(config)
        ids = [int(i) for i in input_ids]
        tries = _Tries(top_k=self._first_top_k(cfg))
        headers = dict(self._auth)
        if session_id is not None:
            headers[SESSION_HEADER] = str(session_id)
        if min_weight_version is not None:
            headers[MIN_VERSION_HEADER] = str(int(min_weight_version))
        if self.adapters:
            headers[ADAPTER_REQUEST_HEADER] = ADAPTER_NEWEST
        while True:
            tries.attempts += 1
            body = build_generate_request(ids, cfg, sampling_seed=sampling_seed, top_k_override=tries.top_k)
            self.stats.requests += 1
            try:
                resp = await self._http.post(
                    self.base_url + "/generate",
                    content=dumps_json(body),
                    headers={**headers, "Content-Type": "application/json"},
                )
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                await self._retry_unavailable("transport", f"{type(exc).__name__}: {exc}", None, tries)
                continue
            if resp.status_code == 200:
                return self._accept(resp, ids, cfg, tries.attempts)
            await self._retry_error_status(resp, cfg, tries)

    def _first_top_k(self, cfg: SamplingConfig) -> int:
        """The top_k of the first post: the config's, capped in support mode by the server's known mask cap."""
        top_k = cfg.wire_top_k()
        if cfg.mode == SUPPORT_MODE and self.mask_cap is not None and top_k > self.mask_cap:
            top_k = self.mask_cap
        return top_k

    async def _retry_unavailable(self, reason: str, message: str, status: int | None, tries: _Tries) -> None:
        """Back off before the next post after a transport error or an unavailable status; TurnFailed
        once the policy's transport retries are spent."""
        tries.transport += 1
        if tries.transport > self.policy.max_transport_retries:
            raise self._fail("unavailable", message, status, tries.attempts) from None
        await self._backoff(reason, tries.transport)

    async def _retry_error_status(self, resp: httpx.Response, cfg: SamplingConfig, tries: _Tries) -> None:
        """Prepare the next post after a non-200 answer (wait, or shrink top_k), or raise TurnFailed
        when the status is final or its retries are spent."""
        p = self.policy
        status = resp.status_code
        message = _message_of(resp)
        if status in UNAVAILABLE_STATUSES:
            await self._retry_unavailable(f"http_{status}", message, status, tries)
        elif status == 409:
            tries.version_waits += 1
            if tries.version_waits > p.max_version_retries:
                raise self._fail("version_conflict", message, status, tries.attempts)
            self.stats.retries["version_conflict"] += 1
            await asyncio.sleep(self._retry_after(resp, tries.version_waits))
        elif status == 400:
            self._shrink_after_bad_request(message, cfg, tries)
        elif status == 500:
            tries.server_errors += 1
            if tries.server_errors > p.max_server_error_retries:
                raise self._fail("server_error", message, status, tries.attempts)
            self.stats.retries["server_error"] += 1
        else:
            raise self._fail(f"http_{status}", message, status, tries.attempts)

    def _shrink_after_bad_request(self, message: str, cfg: SamplingConfig, tries: _Tries) -> None:
        """A 400 is retried only as one of SGLang's sampling-mask refusals, with a smaller top_k."""
        smaller = self._smaller_top_k(message, tries.top_k) if cfg.mode == SUPPORT_MODE else None
        if smaller is None or tries.shrinks >= self.policy.max_shrink_retries:
            raise self._fail("bad_request", message, 400, tries.attempts)
        tries.shrinks += 1
        tries.top_k = smaller
        self.stats.retries["shrink_top_k"] += 1

    def _accept(
        self, resp: httpx.Response, ids: list[int], cfg: SamplingConfig, attempts: int
    ) -> SampledTurn:
        try:
            adapter = self._adapter_version(resp)
            payload = loads_json(resp.content)
            if isinstance(payload, list) and len(payload) == 1:  # batch form with one request
                payload = payload[0]
            turn = parse_generate_response(
                payload,
                ids,
                group=resp.headers.get(GROUP_HEADER) or self.group,
                replica=resp.headers.get(REPLICA_HEADER) or self.replica,
                vocab_size=self.vocab_size,
                untruncated=not cfg.truncates,
                routed_experts_top_k=cfg.routed_experts_top_k,
                weight_version=adapter,
            )
        except (ProtocolError, ValueError) as exc:  # orjson.JSONDecodeError and json's are ValueErrors
            raise self._fail("malformed_response", str(exc), 200, attempts) from None
        # Who served the turn is the router's header (or this client's own group), never the engine's body:
        # an engine writing another group's rlfleet_group into its meta_info (a duplicate key after the
        # router's, which wins on parsing) would charge its invalid tokens to that group.
        turn.group = resp.headers.get(GROUP_HEADER) or self.group or turn.group
        turn.replica = resp.headers.get(REPLICA_HEADER) or self.replica or turn.replica
        self.stats.turns += 1
        self.stats.tokens += turn.num_tokens
        self.stats.invalid += turn.num_invalid
        self.stats.invalid_tokens.update(turn.invalid_reasons)
        return turn

    def _adapter_version(self, resp: httpx.Response) -> int | None:
        """Adapter mode: the version of the adapter the turn ran on, the router's header (like the group and
        replica, never read from the engine's body). ProtocolError when it is missing or not a version."""
        if not self.adapters:
            return None
        raw = resp.headers.get(ADAPTER_VERSION_HEADER)
        if raw is None:
            raise ProtocolError(
                f"a 200 without {ADAPTER_VERSION_HEADER}: {self.base_url} is not rlfleet's router, which "
                "LoRA adapters need (it names each request's adapter and says which one ran)"
            )
        try:
            version = int(raw)
        except ValueError:
            version = -1
        if version < 0:
            raise ProtocolError(
                f"{ADAPTER_VERSION_HEADER} must be a weight version (an int >= 0), got {raw!r}"
            )
        return version

    def _smaller_top_k(self, message: str, top_k: int) -> int | None:
        """The top_k to resend after one of SGLang's sampling-mask 400s (None: the 400 is final)."""
        found = mask_cap_error(message)
        if found is None:
            return None
        kind, cap = found
        self.mask_cap = cap
        if kind == "top_k_rejected":
            smaller = cap if 1 < cap < top_k else None
        else:  # support_overflow: ties past the cutoff; leave headroom under the cap
            smaller = max(self.policy.min_top_k, min(top_k, cap) // 2)
            smaller = smaller if smaller < top_k else None
        return smaller

    def _fail(self, reason: str, message: str, status: int | None, attempts: int) -> TurnFailed:
        self.stats.failures[reason] += 1
        return TurnFailed(reason, message, status, attempts)

    async def _backoff(self, reason: str, attempt: int) -> None:
        self.stats.retries[reason] += 1
        await asyncio.sleep(self.policy.backoff(attempt, self._rng.random()))

    def _retry_after(self, resp: httpx.Response, attempt: int) -> float:
        try:
            wait = float(resp.headers.get("Retry-After", ""))
        except ValueError:
            wait = self.policy.backoff_initial_s * attempt
        return max(0.0, min(wait, self.policy.version_wait_cap_s))

    # ------------------------------------------------------------------------------------ info
    async def get_json(self, path: str) -> Any:
        resp = await self._http.get(self.base_url + path, headers=self._auth)
        resp.raise_for_status()
        return resp.json()

    async def healthy(self) -> bool:
        try:
            resp = await self._http.get(self.base_url + "/health")
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def discover_mask_cap(self) -> int | None:
        """Read --sampling-mask-max-tokens from /server_info (SGLang echoes its server args there)."""
        info = await self.get_json("/server_info")
        cap = info.get("sampling_mask_max_tokens") if isinstance(info, Mapping) else None
        if cap is not None:
            self.mask_cap = int(cap)
        return self.mask_cap


def _message_of(resp: httpx.Response) -> str:
    try:
        return error_message(loads_json(resp.content))
    except ValueError:
        return resp.text[:500]
