"""The metric names and labels our rebalancer reads are the ones SGLang 0.5.23's metrics collectors
register and export: SchedulerMetricsCollector and TokenizerMetricsCollector (srt/observability/
metrics_collector.py) run here on a private prometheus registry (through their own dependency-injection
hooks for the metric classes), fed as SGLang's scheduler and tokenizer manager feed them, and their
exposition text is parsed by operator/rebalance.py."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sglang.srt.observability import metrics_collector as mc
from sglang.srt.runtime_context import use_context
from sglang_made import context, forget_sglang_default_registry_metrics

from rlfleet.operator import rebalance as rb
from rlfleet.operator import rebalancer as timer

LABELS = {"model_name": "qwen3", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}


class SGLangServer:
    """SGLang's two collectors of one server. They live in different processes there (scheduler,
    tokenizer manager) and /metrics merges them; here each gets a private registry. One per test
    process: SGLang's GaugeHistogram registers itself in prometheus' default registry."""

    def __init__(self) -> None:
        self.registries = (CollectorRegistry(), CollectorRegistry())

        def injected(base: type, registry: CollectorRegistry) -> type:
            kinds = {
                f"_{n}_cls": functools.partial(c, registry=registry)
                for n, c in (
                    ("counter", Counter),
                    ("gauge", Gauge),
                    ("histogram", Histogram),
                    ("summary", Summary),
                )
            }
            return type(base.__name__, (base,), kinds)

        ctx = context("scheduler")
        forget_sglang_default_registry_metrics()
        with use_context(ctx):
            self.scheduler = injected(mc.SchedulerMetricsCollector, self.registries[0])(
                labels=dict(LABELS), server_args=ctx.server_args
            )
            self.tokenizer = injected(mc.TokenizerMetricsCollector, self.registries[1])(
                server_args=ctx.server_args, labels={"model_name": "qwen3"}
            )
        forget_sglang_default_registry_metrics()  # leave no global state for the next collector

    def decode_step(self, tokens: int, throughput: float) -> None:
        """What SGLang's metrics reporter does every decode batch / log interval."""
        self.scheduler.increment_realtime_tokens(
            None, decode_tokens=tokens, prefill_compute_tokens=tokens // 4
        )
        stats = mc.SchedulerStats()
        stats.gen_throughput = throughput
        stats.num_running_reqs = mc.QueueCount(total=64)
        self.scheduler.log_stats(stats)

    def finish_request(self, generated: int) -> None:
        self.tokenizer.observe_one_finished_request(
            {"model_name": "qwen3"},
            prompt_tokens=100,
            generation_tokens=generated,
            cached_tokens=0,
            e2e_latency=1.0,
            has_grammar=False,
        )

    def metrics(self) -> str:
        return "".join(generate_latest(r).decode() for r in self.registries)


@functools.cache
def server() -> SGLangServer:
    return SGLangServer()


def test_names_we_read_are_registered_by_sglang() -> None:
    text = server().metrics()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (rb.THROUGHPUT_GAUGE, rb.RUNNING_GAUGE, rb.QUEUE_GAUGE):
        assert families[name].type == "gauge", name
    for name in (rb.DECODE_COUNTER, rb.TOKENS_COUNTER, rb.REQUESTS_COUNTER):
        assert families[name].type == "counter", name
    # the Prometheus query reads the decode counter by its exported sample name and `mode` label
    query = timer.prometheus_query("ns", "job-h100-fp8", 60)
    assert f'{rb.DECODE_COUNTER}_total{{mode="{rb.DECODE_MODE}",' in query
    source = mc.SchedulerMetricsCollector.increment_realtime_tokens.__code__.co_consts
    assert rb.DECODE_MODE in source  # SGLang's own label value for decode tokens


def test_busy_server_with_long_rollouts_reads_its_decode_rate_not_zero() -> None:
    """64 long rollouts decoding at 1000 tok/s for 30 s: no request finishes, so SGLang's
    generation_tokens_total stays 0; the rebalancer reads 1000 tok/s from the decode counter."""
    srv = server()
    config = rb.RebalanceConfig(smoothing=1.0)
    start = rb.parse_sglang_metrics(srv.metrics())
    finished_before = start.generation_tokens_total or 0.0
    decoded_before = start.realtime_decode_tokens_total or 0.0
    state = None
    readings = []
    for second in range(0, 40, 10):
        if second:
            for _ in range(10):
                srv.decode_step(tokens=1000, throughput=1000.0)
        sample = rb.parse_sglang_metrics(srv.metrics())
        assert (sample.generation_tokens_total or 0.0) == finished_before  # nothing finished
        result = rb.rebalance(
            [rb.GroupInput("busy", 1, 1, 1.0, pods={"busy-0": sample})], state, float(second), config
        )
        readings.append(result.groups["busy"].tokens_per_second)
        state = result.state
    assert readings[1:] == [1000.0, 1000.0, 1000.0]  # reading 0 has no counter history: the gauge
    sample = rb.parse_sglang_metrics(srv.metrics())
    assert sample.realtime_decode_tokens_total == decoded_before + 30_000.0  # prefill tokens are not decode
    assert sample.gen_throughput == 1000.0 and sample.num_running_reqs == 64

    srv.finish_request(generated=30_000)  # now the finish-time counter moves, all at once
    assert rb.parse_sglang_metrics(srv.metrics()).generation_tokens_total == finished_before + 30_000.0
