"""Routing replay (R3, trainer/backends/routing_replay.py, RLJob correction.routingReplay) on the real tiny Qwen3-MoE:
replaying the trainer's own choice changes nothing; a replayed (altered) token's MoE output and its router
gradient are exactly those computed by hand from the expert weights and the router softmax; the backend's
step replays the sampler's experts while the routing-mismatch metric stays measured against the trainer's
own routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.hf_backend_steps import (
    GROUPS,
    SMALL_MOE,
    SMALL_QWEN3,
    cpu_backend,
    one_step,
    ragged_batch,
    spawn,
)
from test_trainer_routing import ROUTING_KEYS, transformers_routing

from rlfleet.trainer.backends.routing_replay import replay_routing

# one torch thread (tests/conftest.py `one_torch_thread`): with two, a replayed forward sends each expert its
# tokens in another composition than the plain one, the matmuls block differently, and logits moved by
# 1.2e-6 (3 ulp; seen alone in this file, while the whole suite's order hid it)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
SEQ = 12


def load(ckpt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)


def own_routing(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-2 experts transformers' router picks per position and layer (hooks on each layer's gate,
    no code under test): int64 [SEQ, layers, 2], and the logits of that plain forward."""
    chosen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False).logits[0]
    for h in hooks:
        h.remove()
    return torch.stack(chosen, dim=1), logits


@pytest.fixture
def moe(tiny_qwen3_factory) -> tuple[torch.nn.Module, torch.Tensor]:
    model = load(tiny_qwen3_factory(**SMALL_MOE))
    assert model.model.layers[0].mlp.gate.norm_topk_prob  # Qwen3-MoE renormalises its top-k
    return model, torch.from_numpy(np.random.default_rng(0).integers(3, SMALL_MOE["vocab_size"], (1, SEQ)))


def test_replaying_the_trainers_own_routing_changes_no_logit(moe) -> None:
    model, ids = moe
    own, plain = own_routing(model, ids)
    for replayed in (own, own.flip(-1)):  # the same sets, either order
        with torch.no_grad(), replay_routing(model, replayed):
            got = model(input_ids=ids, use_cache=False).logits[0]
        torch.testing.assert_close(got, plain, rtol=0, atol=1e-6)
    with torch.no_grad():  # the hooks are gone after the block
        torch.testing.assert_close(model(input_ids=ids, use_cache=False).logits[0], plain, rtol=0, atol=0)


def hand_moe(block: torch.nn.Module, x: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """Qwen3-MoE's output for one token x [H] routed to `experts`, from the weights: the router softmax
    over all experts, taken at `experts` and renormalised (norm_topk_prob), weighting each expert's SwiGLU
    down(silu(gate x) * up x), gate and up the two halves of gate_up_proj."""
    probs = torch.softmax(block.gate.weight @ x, dim=-1)
    weights = probs[experts] / probs[experts].sum()
    out = torch.zeros_like(x)
    for w, e in zip(weights, experts, strict=True):
        gate, up = (block.experts.gate_up_proj[e] @ x).chunk(2)
        out = out + w * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def test_an_altered_token_gets_the_hand_computed_moe_output_and_router_gradient(moe) -> None:
    """Position 7 of layer 0 routed to the two experts its router ranks LAST (every other position and
    layer: rows of -1, routed as usual): its layer-0 MoE output equals the hand-computed one, every
    earlier position's logits are unchanged (causal), its own differ; d(output . c)/d(router weight)
    equals the hand reference's (the gate weights carry the router's gradient)."""
    model, ids = moe
    own, plain = own_routing(model, ids)
    block = model.model.layers[0].mlp
    token = 7
    replayed = torch.full_like(own, -1)
    with torch.no_grad():
        captured_plain: list[torch.Tensor] = []
        h = block.register_forward_hook(
            lambda _m, args, out: captured_plain.append(args[0][0, token].clone())
        )
        model(input_ids=ids, use_cache=False)
        h.remove()
        last_two = torch.softmax(block.gate.weight @ captured_plain[0], -1).argsort()[:2].tolist()
    assert not set(last_two) & set(own[token, 0].tolist())  # top-2 of 4: the bottom two are other experts
    replayed[token, 0] = torch.tensor(last_two)

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    h = block.register_forward_hook(lambda _m, args, out: seen.append((args[0][0], out[0])))
    with replay_routing(model, replayed):
        logits = model(input_ids=ids, use_cache=False).logits[0]
    h.remove()
    x, out = seen[0]
    want = hand_moe(block, x[token].detach(), last_two)
    torch.testing.assert_close(out[token], want, rtol=0, atol=1e-6)
    assert (
        want - hand_moe(block, x[token].detach(), own[token, 0].tolist())
    ).abs().max() > 1e-3  # a real change
    # the positions before the altered token are unchanged up to fp32 rounding: a run with a replayed route sums
    # in another order (one run here: 1.19e-6 on a logit of 3.2, 3.8e-7 relative), so float32's own rtol
    torch.testing.assert_close(logits[:token].detach(), plain[:token], rtol=1.3e-6, atol=1e-6)
    assert (logits[token].detach() - plain[token]).abs().max() > 1e-4

    c = torch.randn(x.shape[-1], generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    (out[token] @ c).backward()
    got = block.gate.weight.grad.clone()
    assert got.abs().max() > 1e-6
    weight = block.gate.weight.detach().clone().requires_grad_(True)
    probs = torch.softmax(weight @ x[token].detach(), dim=-1)
    w = probs[last_two] / probs[last_two].sum()
    expert_out = [
        hand_moe(block, x[token].detach(), [e]).detach() for e in last_two
    ]  # each expert alone, weight 1
    (sum(wi * (eo @ c) for wi, eo in zip(w, expert_out, strict=True))).backward()
    torch.testing.assert_close(got, weight.grad, rtol=0, atol=1e-6)


def test_replay_refuses_what_it_cannot_replay(moe, tiny_qwen3_factory) -> None:
    model, ids = moe
    own, _ = own_routing(model, ids)
    with (
        pytest.raises(ValueError, match=r"\[positions, 2 MoE layers, top_k\]"),
        replay_routing(model, own[:, :1]),
    ):
        pass
    bad = own.clone()
    bad[0, 0, 0] = 4
    with pytest.raises(ValueError, match="expert id 4 >= the model's 4 experts"), replay_routing(model, bad):
        pass
    with pytest.raises(ValueError, match="has no Qwen3-MoE router"):
        cpu_backend(tiny_qwen3_factory(**SMALL_QWEN3), routing_replay=True)


def _step(
    ckpt: Path, flat, replay: bool, **kwargs
) -> tuple[dict[str, float], float, dict[str, torch.Tensor]]:
    backend = cpu_backend(ckpt, routing_replay=replay, **kwargs)
    out, _ = backend.train_step(flat, GROUPS)
    grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if "mlp.gate" in n}
    return out.metrics, float(out.loss), grads


@pytest.mark.parametrize("budget", [24, 1 << 14])
def test_a_replayed_step_uses_the_samplers_experts_and_measures_the_trainers_own(
    tiny_qwen3_factory, budget
) -> None:
    """The backend's step with replay: the sampler's experts = the trainer's own -> the loss and router
    gradients of a step without replay. Then layer 1 (the last, whose router input no replay changes) of
    every 3rd row altered: the loss moves, the routing mismatch is exactly those rows (against the
    trainer's own routing, not the replayed one, which would read 0), the routers get gradients, and
    activation checkpointing (the layer recomputed in backward) gives the same step."""
    ckpt = tiny_qwen3_factory(**SMALL_MOE)
    flat = ragged_batch()
    own, gap = transformers_routing(ckpt, flat)
    assert gap > 1e-4
    flat.trainer_version, flat.versions = 1, np.ones(flat.num_tokens, dtype=np.int64)
    flat.routed_experts = own
    base_metrics, base_loss, base_grads = _step(ckpt, flat, False, max_tokens_per_micro_batch=budget)
    metrics, loss, grads = _step(ckpt, flat, True, max_tokens_per_micro_batch=budget)
    assert loss == pytest.approx(base_loss, abs=1e-6) and metrics["routing_mismatch_layers"] == 0.0
    for name, g in grads.items():
        torch.testing.assert_close(g, base_grads[name], rtol=0, atol=1e-6)

    altered = own.copy()
    rows = np.arange(flat.num_tokens) % 3 == 0
    for row in np.flatnonzero(rows):
        altered[row, 1] = [e for e in range(4) if e not in own[row, 1]]
    flat.routed_experts = altered
    metrics, loss, grads = _step(ckpt, flat, True, max_tokens_per_micro_batch=budget)
    assert abs(loss - base_loss) > 1e-6
    assert {k: metrics[k] for k in ROUTING_KEYS} == pytest.approx(
        {
            "routing_tokens": flat.num_tokens,
            "routing_mismatch_tokens": rows.mean(),
            "routing_mismatch_layers": rows.mean() / 2,
        },
        abs=1e-12,
    )
    assert all(g.abs().max() > 0 for g in grads.values()) and len(grads) == 2
    assert any((g - base_grads[n]).abs().max() > 1e-6 for n, g in grads.items())
    _, ckpt_loss, ckpt_grads = _step(
        ckpt, flat, True, max_tokens_per_micro_batch=budget, activation_checkpointing=True
    )
    assert ckpt_loss == pytest.approx(loss, abs=1e-6)
    for name, g in ckpt_grads.items():
        torch.testing.assert_close(g, grads[name], rtol=0, atol=1e-6)


def _altered_routing(ckpt: Path) -> np.ndarray:
    """transformers' own routing of the RAGGED batch with layer 1 of every 3rd row moved to the other two experts."""
    own, _ = transformers_routing(ckpt, ragged_batch())
    for row in range(0, len(own), 3):
        own[row, 1] = [e for e in range(4) if e not in own[row, 1]]
    return own


def _replayed_step_job(rank: int, ckpt: str, routed: np.ndarray) -> dict:
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=24, routing_replay=True)
    assert backend.distributed and backend.world == 2
    flat = ragged_batch()
    flat.routed_experts = routed
    step = one_step(backend, flat)
    return {
        "loss": step["loss"],
        "metrics": step["metrics"],
        "grads": {n: g for n, g in step["grads"].items() if "mlp.gate" in n},
    }


@pytest.mark.timeout(240)
@pytest.mark.slow  # two spawned processes import torch + transformers
def test_two_gloo_ranks_replay_as_one_process(tmp_path: Path, tiny_qwen3_factory) -> None:
    """FSDP2 over 2 gloo ranks (the hooks on routers inside sharded layers), each with its own sequences and
    micro-batches: the same loss, routing metrics and router gradients as one replaying process, whose loss
    differs from a plain step's (the replay took effect). No load-balancing loss here: it is taken per
    micro-batch, and the ranks' micro-batches are not the one process's, so it alone would move the gradients."""
    ckpt = tiny_qwen3_factory(**dict(SMALL_MOE, router_aux_loss_coef=0.0))
    routed = _altered_routing(ckpt)
    flat = ragged_batch()
    flat.routed_experts = routed
    one = one_step(cpu_backend(ckpt, routing_replay=True), flat)
    plain = one_step(cpu_backend(ckpt), flat)
    assert abs(one["loss"] - plain["loss"]) > 1e-6
    ranks = spawn(tmp_path, _replayed_step_job, str(ckpt), routed)
    assert ranks[0]["loss"] == pytest.approx(one["loss"], abs=1e-6)
    for key in ROUTING_KEYS:
        assert ranks[0]["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-12)
    for name, g in ranks[0]["grads"].items():
        torch.testing.assert_close(g, one["grads"][name], rtol=0, atol=1e-6)
