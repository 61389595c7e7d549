"""Routing mismatch of a mixture of experts (trainer/backends/routing.py): the exact shares on hand-made arrays
(top-k sets compared as sets), the sampler's routing carried from the turns to the batch rows, and the
transformers backend's step on the real tiny Qwen3-MoE measuring it against the experts transformers'
own router picks, overall and per group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.episode_outcomes import finished_outcome
from support.hf_backend_steps import (
    GROUPS,
    SMALL_MOE,
    SMALL_QWEN3,
    cpu_backend,
    ragged_batch,
    spawn,
)

from rlfleet.records import SampledTurn
from rlfleet.trainer.backends.backend_common import combine_metrics
from rlfleet.trainer.backends.routing import routing_metrics, routing_mismatch
from rlfleet.trainer.envs.prompts import Prompt
from rlfleet.trainer.metrics import objective_metrics
from rlfleet.trainer.objective import LossOutput
from rlfleet.trainer.rollout.batching import FlatBatch, flatten_groups
from rlfleet.trainer.rollout.driver import PromptGroup, Rollout

ROUTING_KEYS = ("routing_tokens", "routing_mismatch_tokens", "routing_mismatch_layers")


def test_mismatch_compares_sets_not_orders() -> None:
    # 3 tokens, 2 layers, top-2; the sampler lists the same sets in another order, except token 1's
    # layer 0 ({0, 3} vs {0, 2}) and token 2's both layers
    trainer = np.array([[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[1, 2], [0, 1]]])
    sampler = np.array([[[1, 0], [3, 2]], [[3, 0], [3, 1]], [[2, 3], [1, 3]]])
    token_differs, layer_share = routing_mismatch(trainer, sampler)
    assert token_differs.tolist() == [False, True, True]
    assert layer_share.tolist() == [0.0, 0.5, 1.0]
    assert routing_metrics(token_differs, layer_share, np.ones(3, dtype=bool)) == {
        "routing_tokens": 3.0,
        "routing_mismatch_tokens": 2 / 3,
        "routing_mismatch_layers": 1.5 / 3,
    }
    assert routing_metrics(token_differs, layer_share, np.array([True, False, True])) == {
        "routing_tokens": 2.0,
        "routing_mismatch_tokens": 0.5,
        "routing_mismatch_layers": 0.5,
    }
    assert routing_metrics(token_differs, layer_share, np.zeros(3, dtype=bool)) == {}  # no token: no metric
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        routing_mismatch(trainer, sampler[:, :1])


def test_combined_parts_weight_the_mismatch_by_compared_tokens() -> None:
    a = {
        "num_tokens": 4.0,
        "invalid_tokens": 0.0,
        "kl_k3": 0.1,
        "routing_tokens": 1.0,
        "routing_mismatch_tokens": 1.0,
        "routing_mismatch_layers": 0.5,
    }
    b = {
        "num_tokens": 2.0,
        "invalid_tokens": 0.0,
        "kl_k3": 0.4,
        "routing_tokens": 3.0,
        "routing_mismatch_tokens": 0.0,
        "routing_mismatch_layers": 0.25,
    }
    dense = {"num_tokens": 2.0, "invalid_tokens": 0.0, "kl_k3": 0.4}
    got = combine_metrics([a, b, dense])
    assert got["routing_tokens"] == 4.0 and got["routing_mismatch_tokens"] == 0.25
    assert got["routing_mismatch_layers"] == pytest.approx((0.5 + 0.75) / 4, abs=1e-15)
    assert not set(ROUTING_KEYS) & set(combine_metrics([dense, dense]))  # a dense model: no routing metric


def _turn(prompt: list[int], output: list[int], version: int, routed: np.ndarray | None) -> SampledTurn:
    n = len(output)
    return SampledTurn.from_lists(
        prompt,
        output,
        [-0.5] * n,
        [[t] for t in output],
        [[0.0]] * n,
        version,
        sampled_logprobs=[0.0] * n,
        group="g",
        routed_experts=routed,
    ).validate()


def pattern(positions: int, layers: int = 2) -> np.ndarray:
    """int32 [positions, layers, 2]: position p, layer l routed to experts (p + l, 100 + p) (readable ids)."""
    p, layer = np.arange(positions)[:, None], np.arange(layers)[None, :]
    return np.stack([p + layer, 100 + p + 0 * layer], axis=2).astype(np.int32)


def test_flatten_carries_each_rows_sampler_routing_at_its_logit_position() -> None:
    """A two-turn episode (prompt 3 ids, turn 0 of 2 tokens, 2 env ids, turn 1 of 2 tokens): the row of a
    token at sequence position s carries the routing of position s - 1 (SGLang's row P - 1 + i); a
    rollout whose turns returned none has rows of -1; the trainer's version is recorded."""
    prompt = [5, 6, 7]
    turn0 = _turn(prompt, [8, 9], 1, pattern(3 + 2 - 1))
    turn1 = _turn([5, 6, 7, 8, 9, 1, 2], [10, 11], 2, pattern(7 + 2 - 1))
    outcome = finished_outcome(1.0, num_turns=2, tool_calls=1)
    routed = Rollout(Prompt(0, prompt), 0, [turn0, turn1], [[1, 2], []], outcome)
    plain = Rollout(Prompt(0, prompt), 1, [_turn(prompt, [4], 2, None)], [[]], outcome)
    flat = flatten_groups([PromptGroup(Prompt(0, prompt), [routed, plain])], trainer_version=2)
    assert flat.row_pos.tolist() == [2, 3, 6, 7, 2] and flat.trainer_version == 2
    assert flat.routed_experts is not None and flat.routed_experts.shape == (5, 2, 2)
    for row, s in enumerate([3, 4, 7, 8]):
        assert flat.routed_experts[row].tolist() == [[s - 1, 100 + s - 1], [s, 100 + s - 1]]
    assert (flat.routed_experts[4] == -1).all()
    dense = flatten_groups([PromptGroup(Prompt(0, prompt), [plain])], trainer_version=2)
    assert dense.routed_experts is None


# ------------------------------------------------------------------------ the real tiny Qwen3-MoE
def transformers_routing(ckpt: Path, flat: FlatBatch) -> tuple[np.ndarray, float]:
    """Per row, the top-2 experts transformers' own Qwen3-MoE router picks at its logit position (a
    padded forward of the whole batch, no backend code): int [T, layers, 2], and the smallest gap over
    rows and layers between the 2nd and 3rd router probability (so that packing's rounding cannot
    flip a choice the test relies on)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    chosen: list[torch.Tensor] = []
    gaps: list[float] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        out = model.model(
            input_ids=torch.from_numpy(flat.input_ids), use_cache=False, output_router_logits=True
        )
    for h in hooks:
        h.remove()
    b, s = flat.input_ids.shape
    seq, pos = torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)
    for logits in out.router_logits:
        top3 = torch.softmax(logits.reshape(b, s, -1), dim=-1)[seq, pos].topk(3, dim=-1).values
        gaps.append(float((top3[:, 1] - top3[:, 2]).min()))
    experts = torch.stack([c.reshape(b, s, -1)[seq, pos] for c in chosen], dim=1)
    return experts.numpy().astype(np.int32), min(gaps)


@pytest.mark.parametrize("budget", [24, 1 << 14])
def test_a_moe_step_measures_routing_mismatch_exactly(tiny_qwen3_factory, budget: int) -> None:
    """The sampler's experts = transformers' own choice (in reversed order): mismatch exactly 0. Then
    altered in known places: token shares and (token, layer) shares exactly those altered, overall and
    per group, counting only rows sampled at the trainer's version that carry routing; across
    micro-batches (budget 24) as in one."""
    ckpt = tiny_qwen3_factory(**SMALL_MOE)
    flat = ragged_batch()
    own, gap = transformers_routing(ckpt, flat)
    assert gap > 1e-4 and own.shape == (flat.num_tokens, 2, 2)
    flat.trainer_version, flat.versions = 1, np.ones(flat.num_tokens, dtype=np.int64)

    flat.routed_experts = own[:, :, ::-1].copy()  # the same sets, listed the other way round
    out, _ = cpu_backend(ckpt, max_tokens_per_micro_batch=budget).train_step(flat, GROUPS)
    assert {k: out.metrics[k] for k in ROUTING_KEYS} == {
        "routing_tokens": flat.num_tokens,
        "routing_mismatch_tokens": 0.0,
        "routing_mismatch_layers": 0.0,
    }

    altered = own.copy()
    rows = np.arange(flat.num_tokens)
    group = np.array([GROUPS[g] for g in flat.groups])
    # layer 0 of every 3rd row, both layers of every 5th: one expert swapped for one outside the set
    for row in rows:
        for layer in ([0] if row % 3 == 0 else []) + ([0, 1] if row % 5 == 0 else []):
            outside = next(e for e in range(4) if e not in altered[row, layer])
            altered[row, layer, 1] = outside
    differs = (np.sort(altered, -1) != np.sort(own, -1)).any(-1)  # [T, layers], as set by hand above
    assert differs.any() and not differs.all()
    stale = flat.row_seq == 0  # sampled one version before the trainer's: not at the same weights
    missing = flat.row_seq == 1  # its turns returned no routing
    flat.versions[stale] = 0
    altered[missing] = -1
    flat.routed_experts = altered
    compared = ~stale & ~missing
    out, _ = cpu_backend(ckpt, max_tokens_per_micro_batch=budget).train_step(flat, GROUPS)

    def want(sel: np.ndarray) -> dict[str, float]:
        return {
            "routing_tokens": float(sel.sum()),
            "routing_mismatch_tokens": float(differs[sel].any(1).mean()),
            "routing_mismatch_layers": float(differs[sel].mean()),
        }

    def got(m: dict[str, float]) -> dict[str, float]:
        return {k: m[k] for k in ROUTING_KEYS}

    assert got(out.metrics) == pytest.approx(want(compared), abs=1e-12)
    for gid in (0, 1):
        assert got(out.per_group[gid]) == pytest.approx(want(compared & (group == gid)), abs=1e-12)
    flat_metrics = objective_metrics(out, list(GROUPS), {})
    assert flat_metrics["group/h100-fp8/routing_mismatch_layers"] == pytest.approx(
        want(compared & (group == 1))["routing_mismatch_layers"], abs=1e-12
    )


def _routed_batch(routed: np.ndarray) -> FlatBatch:
    flat = ragged_batch()
    flat.routed_experts = routed
    return flat


def _routing_step_job(rank: int, ckpt: str, routed: np.ndarray) -> dict:
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=24)
    assert backend.distributed and backend.world == 2
    out, _ = backend.train_step(_routed_batch(routed), GROUPS)
    return {"metrics": out.metrics, "per_group": out.per_group}


@pytest.mark.timeout(240)
@pytest.mark.slow  # two spawned processes import torch + transformers
def test_two_gloo_ranks_measure_the_same_routing_mismatch_as_one_process(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    """FSDP2 over 2 gloo ranks, each with its own sequences and micro-batches: the merged routing metrics
    equal one process's (every row at the trainer's version 0; the sampler's experts altered in every
    4th row's layer 1)."""
    ckpt = tiny_qwen3_factory(**SMALL_MOE)
    routed, _ = transformers_routing(ckpt, ragged_batch())
    for row in range(0, len(routed), 4):
        routed[row, 1, 0] = next(e for e in range(4) if e not in routed[row, 1])
    one, _ = cpu_backend(ckpt).train_step(_routed_batch(routed), GROUPS)
    assert one.metrics["routing_mismatch_layers"] == pytest.approx(
        len(range(0, len(routed), 4)) / (2 * len(routed))
    )
    ranks = spawn(tmp_path, _routing_step_job, str(ckpt), routed)
    for key in ROUTING_KEYS:
        assert ranks[0]["metrics"][key] == pytest.approx(one.metrics[key], abs=1e-12)
        for gid in (0, 1):
            assert ranks[0]["per_group"][gid][key] == pytest.approx(one.per_group[gid][key], abs=1e-12)


def test_a_dense_model_reports_no_routing(tiny_qwen3_factory) -> None:
    """A dense Qwen3 given a batch with routing (it cannot have any): no routing metric."""
    flat = ragged_batch()
    flat.routed_experts = np.zeros((flat.num_tokens, 2, 2), dtype=np.int32)
    out, _ = cpu_backend(tiny_qwen3_factory(**SMALL_QWEN3)).train_step(flat, GROUPS)
    assert not set(ROUTING_KEYS) & (set(out.metrics) | {k for m in out.per_group.values() for k in m})


def test_the_group_mismatch_reaches_prometheus_and_the_operators_reading() -> None:
    """A step's flat metrics through the trainer's exporter: `rlfleet_trainer_routing_mismatch_tokens
    {scope="group"}` as the operator's scrape reads it (operator/rebalance.py), which feeds the
    SamplerGroup's status.routingMismatch."""
    import httpx

    from rlfleet.operator.rebalance import parse_trainer_group_metrics
    from rlfleet.trainer.metrics import PrometheusExporter

    group = {
        "num_tokens": 4.0,
        "invalid_tokens": 0.0,
        "routing_tokens": 4.0,
        "routing_mismatch_tokens": 0.25,
        "routing_mismatch_layers": 0.125,
    }
    out = LossOutput(loss=torch.zeros(()), metrics=dict(group), per_group={1: dict(group)})
    exporter = PrometheusExporter(port=0)
    try:
        exporter.update(3, objective_metrics(out, list(GROUPS), {}))
        text = httpx.get(f"http://127.0.0.1:{exporter.port}/metrics").text
    finally:
        exporter.close()
    assert 'rlfleet_trainer_routing_mismatch_tokens{key="",scope="fleet"} 0.25' in text
    read = parse_trainer_group_metrics(text)["h100-fp8"]
    assert read["routing_mismatch_tokens"] == 0.25 and read["routing_mismatch_layers"] == 0.125


@pytest.mark.parametrize("spec, top_k", [(SMALL_MOE, SMALL_MOE["num_experts_per_tok"]), (SMALL_QWEN3, 0)])
def test_every_rollout_asks_a_moe_models_samplers_for_their_routing(tiny_qwen3_factory, spec, top_k) -> None:
    """The cluster entrypoint and local mode take their turns' sampling from `rollout_sampling`: for a
    mixture of experts each turn asks for its routed experts (the cluster entrypoint did not ask, so
    it measured no routing mismatch); a dense model's turns do not. The job's own parameters stay."""
    from types import SimpleNamespace

    from rlfleet.sampler.protocol import SamplingConfig, build_generate_request
    from rlfleet.trainer.run import BaseModel, rollout_sampling

    job_sampling = SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=12)
    base = BaseModel(backend=None, vocab_size=64, max_seq_len=128, source_dir=tiny_qwen3_factory(**spec))  # type: ignore[arg-type]
    sampling = rollout_sampling(SimpleNamespace(sampling=job_sampling), base)  # type: ignore[arg-type]
    assert sampling.routed_experts_top_k == top_k
    assert (sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (0.7, 0.9, 12)
    assert ("return_routed_experts" in build_generate_request([1, 2, 3], sampling)) == bool(top_k)
