"""The reference server's `/metrics`: SGLang's metric names, labels and counting (Prometheus)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from rlfleet.sampler.reference_engine import ReferenceEngine


class ServerMetrics:
    """SGLang's metric names, label names and counting on a private registry (several servers may share
    a process in tests). Gauges and realtime_tokens_total are the scheduler's (labels model_name,
    engine_type, tp_rank, pp_rank, moe_ep_rank); the request counters and latency histograms are the
    tokenizer manager's (model_name, engine_type, is_streaming), counted when a request finishes."""

    TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
    E2E_BUCKETS = (
        0.1,
        0.2,
        0.4,
        0.6,
        0.8,
        1,
        2,
        4,
        6,
        8,
        10,
        20,
        40,
        60,
        80,
        100,
        200,
        400,
        600,
        1200,
        1800,
        2400,
    )

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.sched = {
            "model_name": model_name,
            "engine_type": "unified",
            "tp_rank": "0",
            "pp_rank": "0",
            "moe_ep_rank": "0",
        }
        self.tok = {"model_name": model_name, "engine_type": "unified"}
        self.streamed = {**self.tok, "is_streaming": "false"}
        s, t = list(self.sched), [*self.tok, "is_streaming"]
        self.gen_throughput = Gauge(
            "sglang:gen_throughput", "The generation throughput (token/s).", s, registry=r
        )
        self.num_running = Gauge("sglang:num_running_reqs", "The number of running requests.", s, registry=r)
        self.num_queue = Gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", s, registry=r
        )
        self.token_usage = Gauge("sglang:token_usage", "The token usage.", s, registry=r)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", s, registry=r)
        self.realtime_tokens = Counter(
            "sglang:realtime_tokens",
            "Total number of tokens processed (updated on each log interval). "
            "mode: prefill_compute, prefill_cache, decode.",
            [*s, "mode"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", t, registry=r
        )
        self.gen_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", t, registry=r
        )
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.", t, registry=r)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            t,
            registry=r,
            buckets=self.TTFT_BUCKETS,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            t,
            registry=r,
            buckets=self.E2E_BUCKETS,
        )
        self._exported = {"gen": 0, "prompt": 0, "req": 0, "rt_prefill": 0, "rt_decode": 0}

    def refresh(self, engine: ReferenceEngine) -> None:
        st = engine.stats
        sched, streamed = self.sched, self.streamed
        self.gen_throughput.labels(**sched).set(st.gen_throughput())
        self.num_running.labels(**sched).set(len(engine.running))
        self.num_queue.labels(**sched).set(len(engine.waiting))
        slots = engine.config.max_running_requests
        self.token_usage.labels(**sched).set((slots - len(engine.free_slots)) / slots)
        self.cache_hit_rate.labels(**sched).set(0.0)
        for key, total, counter in (
            ("gen", st.generation_tokens_total, self.gen_tokens.labels(**streamed)),
            ("prompt", st.prompt_tokens_total, self.prompt_tokens.labels(**streamed)),
            ("req", st.requests_total, self.num_requests.labels(**streamed)),
            (
                "rt_prefill",
                st.realtime_prefill_tokens,
                self.realtime_tokens.labels(**sched, mode="prefill_compute"),
            ),
            ("rt_decode", st.realtime_decode_tokens, self.realtime_tokens.labels(**sched, mode="decode")),
        ):
            counter.inc(total - self._exported[key])
            self._exported[key] = total
        while st.finished:
            ttft, e2e = st.finished.popleft()
            if ttft is not None:
                self.ttft.labels(**streamed).observe(ttft)
            self.e2e.labels(**streamed).observe(e2e)
