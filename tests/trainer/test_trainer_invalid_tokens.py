"""A sampler group that answers garbage logprobs is seen PER GROUP (issue 39 item 7): its invalid tokens
are counted per group and per validation reason, its trained fraction (tokens trained / tokens sampled)
falls, the collapse detector raises `invalid_tokens` for it (and with quarantine-group quarantines it
alone), the trainer's exporter carries the counts, and the operator's autopilot quarantines it from what
it parses, with the invalid share and the top reason in the reason.

Real parts: two of the project's reference sampler servers (SGLang API subset, a tiny model on CPU)
behind the real router, the sampler client, the rollout driver, the composition root (trainer/run.py
`run_training`) with the transformers backend on the project's tiny Qwen3, the trainer's Prometheus
exporter over HTTP, and the operator's parser and autopilot. Between the router and the second sampler
("cpu-garbage") a real HTTP proxy corrupts every answer, by output position i: i % 4 == 0 a null
logprob (NaN), 1 a sampling-support row that leaves out the sampled token, 2 a positive logprob (which
also puts log q_S(y) below log q(y)), 3 untouched. It also writes `rlfleet_group: cpu-bf16` into each
meta_info after the router's own (the duplicate key wins on parsing): an engine framing a healthy group
must not move its invalid tokens onto that group. The proxy records every answer it corrupted (prompt
and output ids -> length), so the expected counts are the test's own, from what was sent."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web
from support.autopilot_readings import autopilot_reading
from support.rollout_drivers import driver_factory
from support.tiny_models import LOOP_MODEL

from rlfleet.operator import autopilot, decide
from rlfleet.operator.rebalance import parse_trainer_group_metrics
from rlfleet.records import INVALID_METRIC_PREFIX, R_BAD_LOGPROB, R_NOT_IN_SUPPORT, R_RENORM_BELOW_FULL
from rlfleet.router.config import GroupConfig, RouterConfig
from rlfleet.router.service import start_service
from rlfleet.sampler.client import SamplerClient
from rlfleet.sampler.http_app import start_reference_server
from rlfleet.sampler.reference_engine import EngineConfig, ReferenceEngine, tiny_shape
from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds, Decision
from rlfleet.trainer.metrics import PrometheusExporter
from rlfleet.trainer.rollout.driver import PromptGroup
from rlfleet.trainer.run import build_backend, run_training

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
VOCAB = LOOP_MODEL["vocab_size"]
GOOD, BAD = "cpu-bf16", "cpu-garbage"


class Sink:
    def __init__(self) -> None:
        self.versions: list[int] = []

    def publish(self, weights: dict[str, torch.Tensor], version: int, *, step: int | None = None) -> None:
        self.versions.append(version)

    def fence(self) -> None:  # no writer lease: checkpoints are not fenced
        return None

    def latest_version(self) -> int | None:
        return self.versions[-1] if self.versions else None


def corrupt(meta: dict[str, Any]) -> None:
    """The garbage modes, in place, by output position (module docstring)."""
    otl, mask = meta["output_token_logprobs"], meta["output_token_sampling_mask"]
    for i, entry in enumerate(otl):
        if i % 4 == 0:
            entry[0] = None
        elif i % 4 == 1:  # as many ids, none of them the sampled one
            mask[i] = [v for v in range(VOCAB) if v != entry[1]][: len(mask[i])]
        elif i % 4 == 2:
            entry[0] = 0.5
    meta["rlfleet_group"] = GOOD


async def garbage_proxy(
    upstream: str, sent: dict[tuple[tuple[int, ...], tuple[int, ...]], int]
) -> web.AppRunner:
    """A real HTTP server relaying to `upstream`; /generate answers corrupted, each recorded in `sent`."""

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method,
                upstream + request.path_qs,
                data=body or None,
                headers={"Content-Type": "application/json"},
            ) as answer,
        ):
            data, status = await answer.read(), answer.status
        if request.path == "/generate" and status == 200:
            payload = json.loads(data)
            corrupt(payload["meta_info"])
            ids = tuple(int(t[1]) for t in payload["meta_info"]["output_token_logprobs"])
            sent[(tuple(json.loads(body)["input_ids"]), ids)] = len(ids)
            data = json.dumps(payload).encode()
        return web.Response(body=data, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def expected(
    steps: list[tuple[dict[str, float], list[PromptGroup]]],
    sent: dict[tuple[tuple[int, ...], tuple[int, ...]], int],
) -> list[dict[str, dict[str, int]]]:
    """Per step and group, the counts the step's batch must report, from what each replica was sent: a
    turn the proxy corrupted is the garbage group's, with its positions' reasons; any other the good one's."""
    out = []
    for _, groups in steps:
        counts = {g: {"sampled": 0, "nan": 0, "not_in_support": 0, "positive": 0} for g in (GOOD, BAD)}
        for rollout in (r for g in groups for r in g.rollouts):
            for turn in rollout.turns:
                key = (tuple(int(i) for i in turn.prompt_ids), tuple(int(i) for i in turn.output_ids))
                n = sent.get(key)
                if n is None:
                    counts[GOOD]["sampled"] += turn.num_tokens
                    continue
                c = counts[BAD]
                c["sampled"] += n
                c["nan"] += len(range(0, n, 4))
                c["not_in_support"] += len(range(1, n, 4))
                c["positive"] += len(range(2, n, 4))
        out.append(counts)
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


async def test_a_group_answering_garbage_is_counted_per_group_and_reason_and_the_autopilot_quarantines_it(
    tmp_path: Path, tiny_qwen3_factory: Callable[..., Path], example_run: Callable[..., Any]
) -> None:
    model = tiny_qwen3_factory(**LOOP_MODEL)
    shape = tiny_shape(**LOOP_MODEL)
    good = await start_reference_server(ReferenceEngine(EngineConfig(model=shape, seed=3)))
    bad = await start_reference_server(ReferenceEngine(EngineConfig(model=shape, seed=4)))
    sent: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    proxy = await garbage_proxy(bad.url, sent)
    proxy_url = f"http://127.0.0.1:{proxy.addresses[0][1]}"
    router, runner, port = await start_service(
        RouterConfig(
            port=0,
            health_interval_seconds=0.5,
            groups=[GroupConfig(name=GOOD, replicas=[good.url]), GroupConfig(name=BAD, replicas=[proxy_url])],
        )
    )
    rc = example_run(
        steps=3,
        prompts_per_step=4,
        samples_per_prompt=2,
        max_staleness=None,
        environment="copy_digit",
        dataset=None,
        groups=[(GOOD, "bf16"), (BAD, "bf16")],
    )
    base = build_backend(rc, backend="torch", source_dir=model, max_seq_len=48)
    client = SamplerClient(f"http://127.0.0.1:{port}")
    steps: list[tuple[dict[str, float], list[PromptGroup]]] = []
    decisions: list[Decision] = []
    quarantined: list[list[str]] = []
    # the collapse detector's signal 8 with safety.action quarantine-group, from the first step
    detector = CollapseDetector(CollapseThresholds(warmup_steps=0, patience=1), action="quarantine-group")

    def on_step(m: dict[str, float], decision: Decision, groups: list[PromptGroup]) -> None:
        steps.append((m, groups))
        decisions.append(decision)

    try:
        await asyncio.to_thread(
            run_training,
            rc,
            base.backend,
            Sink(),
            detector,
            driver_factory(rc, base, client, max_seq_len=48),
            checkpoint=tmp_path / "checkpoints",
            on_step=on_step,
            on_quarantine=quarantined.append,
        )
    finally:
        await runner.cleanup()
        await router.close()
        await proxy.cleanup()
        await good.stop()
        await bad.stop()

    assert len(steps) == 3
    wanted = expected(steps, sent)
    assert sum(w[BAD]["sampled"] for w in wanted) > 0 and sum(w[GOOD]["sampled"] for w in wanted) > 0
    for (m, _), w in zip(steps, wanted, strict=True):
        g, b = w[GOOD], w[BAD]
        dropped = b["nan"] + b["not_in_support"] + b["positive"]
        if g["sampled"]:
            assert (m[f"group/{GOOD}/sampled_tokens"], m[f"group/{GOOD}/dropped_invalid_tokens"]) == (
                g["sampled"],
                0,
            )
            assert (
                m[f"group/{GOOD}/trained_fraction"] == 1.0 and m[f"group/{GOOD}/num_tokens"] == g["sampled"]
            )
            assert not [k for k in m if k.startswith(f"group/{GOOD}/{INVALID_METRIC_PREFIX}")]
        if b["sampled"]:
            p = f"group/{BAD}/"
            assert (m[p + "sampled_tokens"], m[p + "dropped_invalid_tokens"]) == (b["sampled"], dropped)
            assert {k[len(p) :]: v for k, v in m.items() if k.startswith(p + INVALID_METRIC_PREFIX)} == {
                f"{INVALID_METRIC_PREFIX}{R_BAD_LOGPROB}": b["nan"] + b["positive"],
                **(
                    {f"{INVALID_METRIC_PREFIX}{R_NOT_IN_SUPPORT}": b["not_in_support"]}
                    if b["not_in_support"]
                    else {}
                ),
                **({f"{INVALID_METRIC_PREFIX}{R_RENORM_BELOW_FULL}": b["positive"]} if b["positive"] else {}),
            }
            assert m.get(p + "num_tokens", 0.0) == b["sampled"] - dropped
            assert m[p + "trained_fraction"] == (b["sampled"] - dropped) / b["sampled"]
        # the fleet: every token of the step's batch, and the loop's own fleet-wide drop count
        assert (m["sampled_tokens"], m["dropped_invalid_tokens"]) == (g["sampled"] + b["sampled"], dropped)

    # The detector saw it at the first step the garbage group sampled, and quarantined it alone, once.
    first = next(i for i, w in enumerate(wanted) if w[BAD]["sampled"])
    m, b = steps[first][0], wanted[first][BAD]
    (alert,) = [a for a in decisions[first].alerts if a.signal == "invalid_tokens"]
    assert (alert.group, alert.value) == (BAD, 1.0 - m[f"group/{BAD}/trained_fraction"])
    assert alert.message == (
        f"group {BAD}: {alert.value:.1%} of its sampled tokens not trained on (invalid), "
        f"top reason {R_BAD_LOGPROB}: {b['nan'] + b['positive']} tokens"
    )
    assert quarantined == [[BAD]] and not [a for d in decisions for a in d.alerts if a.group == GOOD]

    # The trainer's exporter (HTTP) -> the operator's parser -> the autopilot: quarantined, no step up.
    last, want = next(
        (m, w[BAD]) for (m, _), w in zip(reversed(steps), reversed(wanted), strict=True) if w[BAD]["sampled"]
    )
    exporter = PrometheusExporter(port=0)
    try:
        exporter.update(int(last["step"]), last)
        text = scrape(exporter.port)
    finally:
        exporter.close()
    parsed = parse_trainer_group_metrics(text)[BAD]
    invalid = decide.invalid_tokens(parsed)
    bad_logprob = want["nan"] + want["positive"]
    assert (
        invalid[R_BAD_LOGPROB] == bad_logprob
        and parsed["trained_fraction"] == last[f"group/{BAD}/trained_fraction"]
    )
    # within its KL and OOR budgets: only the invalid share can move the autopilot
    reading = autopilot_reading(
        name=BAD,
        trained_fraction=parsed["trained_fraction"],
        invalid_tokens=invalid,
        max_invalid_fraction=0.05,
    )
    (action,), _ = autopilot.autopilot([reading], autopilot.AutopilotMemory(), 1, ("bf16", "fp8", "nvfp4"))
    share = 1.0 - last[f"group/{BAD}/trained_fraction"]
    assert (action.kind, action.to_format) == ("quarantine", None)
    assert action.reason == (
        f"invalid share {share:g} > 0.05 (top reason {R_BAD_LOGPROB}: {bad_logprob} tokens) "
        "for 1 intervals: quarantined (invalid answers are not a precision to step up from)"
    )
