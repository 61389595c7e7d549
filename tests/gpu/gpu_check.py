"""The GPU check (`scripts/gpu-check`): the checks that need a GPU, in one run of at most 8 minutes on
one H100 (docs/testing.md, "The GPU check"). Each check prints one JSON line
{"check", "status": ok | failed | skipped, "device", "seconds", "measured", "tolerance", "reason"}; a
summary line ends the run; the exit status is 0 only when every check that ran held (1 otherwise, 2
when the run itself could not start).

Checks (the product code each one runs):
- `torch_step/qwen3`, `torch_step/qwen3_moe`: one step of the torch backend (trainer/backends/backend_hf.py
  `HFBackend.train_step`: bf16 autocast on a GPU) against the same step in fp32 on the same device, on
  a small Qwen3 and the tiny Qwen3-MoE (rlfleet/tiny_qwen3.py): the loss, the pre-clip gradient norm
  and the whole gradient (relative L2 error) within the bf16 tolerances below.
- `attention/varlen_bf16`: the packed per-sequence attention (trainer/backends/attention.py) under bf16 autocast
  against an fp32 reference with an explicit block-causal mask (output and input gradients), and no
  leak across sequences (changing one sequence's keys and values leaves the others' outputs bit-equal).
- `routing/replay_bf16`: the MoE routing-replay hook (trainer/backends/routing_replay.py) under bf16 autocast:
  every replayed position is routed to exactly the replayed experts, and the router gets a finite,
  non-zero gradient through the replayed gate weights.
- `fsdp2/fused_adamw`: the torch backend on FSDP2 (one rank: nccl on a GPU, gloo on CPU; bf16
  parameters, fp32 reduction) with its fused AdamW: the gradient against the fp32 reference, and the
  update of every element equal to AdamW's first step computed here by hand, lr * g / (|g| + eps).
- `objective/memory_16k`, `objective/memory_64k`: peak memory of the fused lm_head objective
  (trainer/vocab_parallel.py via trainer/objective.py `policy_loss`) against the objective on
  materialised logits (tests/objective/materialized.py) at T = 16K / 64K tokens, V = 151,936:
  `torch.cuda.max_memory_allocated` above what was allocated before (on CPU: the peak resident set,
  VmHWM). Held: fused <= its bound (the weight's and the hidden states' fp32 gradients, 8 logit tiles,
  64 MiB) and fused <= materialised / 2 (a materialised run that runs out of memory counts as larger).
- `megatron_step`: the megatron backend's step (bf16 parameters on a GPU) against the torch backend's
  fp32 step on the same checkpoint and batch (loss and gradient norm); skipped where megatron-core
  cannot be imported (carry its wheel, scripts/gpu-check-wheels.txt).
- `views/fp8`, `views/nvfp4`: the published views' bytes (rlfleet/numerics/views.py `view_tensors`, the
  publisher's own path, from the bf16 weights) dequantised ON THE DEVICE equal the publisher's CPU
  dequantisation exactly, each element within its format's rounding bound of the bf16 weight (fp8
  E4M3: half a step, max(|w| / 16, scale / 1024); nvfp4: half the E2M1 step at |w| / scale, plus any
  saturation above 6), and (fp8) block-128 quantisation on the device gives the published bytes.

`--cpu` runs the same checks on CPU at small sizes (the test command runs it: tests/ship/
test_ship_gpu_check.py); there the torch backend computes in fp32, so the step checks compare fp32 with
fp32 and prove the wiring, not the bf16 tolerances. `--fault CHECK` (or `all`) deliberately feeds that
check a wrong input (perturbed weights, a shifted lr, mis-scaled views, the materialised objective in
the fused one's place, wrong replayed experts), which it must report as failed: the test that a failing
check fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Tolerances of a bf16 forward (autocast; fp32 master weights, fp32 objective) against fp32, on the same
# weights and batch. bf16 keeps 8 significant bits (relative rounding 2^-9 per operation); a few layers of
# matmuls, norms and softmax. Measured on CPU with the torch backend's forward under bf16 autocast (the
# tiny Qwen3, the tiny Qwen3-MoE and a 4-layer, 256-wide Qwen3; ragged batches of 5 sequences): loss within
# 3.3e-4, gradient norm within 0.3%, the whole gradient within 1.1% (relative L2). The tolerances leave
# about 5x of that for the larger GPU model; a wrong cast, a mask or routing bug, a dropped or doubled
# micro-batch moves these by tens of percent (and a fault's 5% weight noise by more than them).
STEP_TOLERANCE = {"loss_abs": 5e-3, "loss_rel": 1e-2, "grad_norm_rel": 2e-2, "grad_rel_l2": 5e-2}
ATTENTION_TOLERANCE = {"out_rel_l2": 2e-2, "grad_rel_l2": 3e-2}
LR = 1e-3
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which OptimConfig.adamw keeps
FAULT_NOISE = 0.05  # relative noise a fault adds to a candidate's weights


@dataclass
class Sizes:
    """What the checks run on: the GPU sizes, or the CPU dry run's."""

    dense: dict[str, Any]
    moe: dict[str, Any]
    step_lengths: list[int]
    max_tokens: int
    attention: dict[str, Any]
    memory_tokens: dict[str, int]
    memory_vocab: int
    memory_hidden: int
    chunk_tokens: int
    chunk_vocab: int


GPU_SIZES = Sizes(
    # a small Qwen3 with the real vocabulary (Qwen3-0.6B's widths, 4 of its 28 layers)
    dense={
        "vocab_size": 151_936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 4096,
    },
    moe={"architecture": "qwen3_moe", "max_position_embeddings": 4096},  # the tiny Qwen3-MoE's widths
    step_lengths=[512, 384, 1024, 256, 768, 640, 896, 448] * 2,
    max_tokens=4096,
    attention={"heads": 16, "kv_heads": 8, "head_dim": 128, "sizes": [1024, 700, 17, 1200, 300]},
    memory_tokens={"objective/memory_16k": 16_384, "objective/memory_64k": 65_536},
    memory_vocab=151_936,
    memory_hidden=2048,  # Qwen3-1.7B's
    chunk_tokens=512,
    chunk_vocab=8192,
)
CPU_SIZES = Sizes(
    dense={"max_position_embeddings": 256},
    moe={"architecture": "qwen3_moe"},
    step_lengths=[40, 24, 56, 31],
    max_tokens=96,
    attention={"heads": 4, "kv_heads": 2, "head_dim": 32, "sizes": [40, 7, 65]},
    memory_tokens={"objective/memory_16k": 512, "objective/memory_64k": 2048},
    memory_vocab=8192,
    memory_hidden=64,
    chunk_tokens=256,
    chunk_vocab=4096,
)


@dataclass
class Context:
    device: Any  # torch.device
    sizes: Sizes
    faults: set[str]
    work: Path
    reference_cache: dict[str, Any] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def fault(self, check: str) -> bool:
        return check in self.faults or "all" in self.faults


class Skip(Exception):
    """The check cannot run here; the message says why."""


class Unavailable(Exception):
    """The run cannot start here (exit 2); the message says why."""


@dataclass
class Outcome:
    held: bool
    measured: dict[str, Any]
    tolerance: dict[str, Any]
    reason: str = ""


# ----------------------------------------------------------------------------------------------
# Imports of the product where it is not installed (the GPU machine: the repository's tree only).
# ----------------------------------------------------------------------------------------------


def import_product() -> None:
    """Make `rlfleet.trainer` & co. importable from the repository's tree: pyproject maps them from the
    top-level folders, which an installed package does; without one (the GPU machine) the package is
    loaded from ./rlfleet with the repository root as a second place for its subpackages, so
    `rlfleet.trainer` is ./trainer. The root itself never goes on sys.path: ./operator would shadow the
    standard library's `operator`."""
    with contextlib.suppress(ImportError):
        import rlfleet.trainer  # noqa: F401

        return
    for name in [m for m in sys.modules if m == "rlfleet" or m.startswith("rlfleet.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "rlfleet",
        REPO / "rlfleet" / "__init__.py",
        submodule_search_locations=[str(REPO / "rlfleet"), str(REPO)],
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlfleet"] = module
    spec.loader.exec_module(module)


def _load_by_path(name: str, path: Path) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _materialized() -> Any:
    """The objective on materialised logits: the tests' reference (production never calls it)."""
    return _load_by_path("rlfleet_gpu_check_materialized", REPO / "tests" / "objective" / "materialized.py")


def _bench_objective() -> Any:
    return _load_by_path("rlfleet_gpu_check_bench_objective", REPO / "benchmarks" / "objective.py")


def _flat_batch(lengths: list[int], vocab: int, seed: int) -> Any:
    """benchmarks/train_step.py's batch: sampled tokens after a prompt, support candidates."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        train_step = _load_by_path("rlfleet_gpu_check_train_step", REPO / "benchmarks" / "train_step.py")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return train_step.make_flat_batch(lengths, vocab, seed)


# ----------------------------------------------------------------------------------------------
# Helpers.
# ----------------------------------------------------------------------------------------------


def _rel_l2(candidate: Any, reference: Any) -> float:
    import torch

    ref = reference.double()
    return float(
        torch.linalg.vector_norm(candidate.double() - ref) / max(float(torch.linalg.vector_norm(ref)), 1e-30)
    )


def _free_port() -> int:
    """tests/support/ports.py's, loaded by path (this script runs alone: tests/ is not on sys.path)."""
    return int(_load_by_path("rlfleet_gpu_check_ports", REPO / "tests" / "support" / "ports.py").free_port())


def _ensure_process_group(ctx: Context) -> None:
    """One process group of one rank for FSDP2 and megatron: nccl on a GPU, gloo on CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    dist.init_process_group(backend="nccl" if ctx.on_gpu else "gloo", rank=0, world_size=1)


def _spec(ctx: Context, kind: str) -> Any:
    from rlfleet.tiny_qwen3 import TinyQwen3

    return TinyQwen3(**(ctx.sizes.dense if kind == "qwen3" else ctx.sizes.moe))


def _model(ctx: Context, kind: str) -> Any:
    """A fresh copy of the seeded model (fp32, CPU), built once per kind."""
    from rlfleet.tiny_qwen3 import tiny_model

    key = f"model/{kind}"
    if key not in ctx.reference_cache:
        ctx.reference_cache[key] = tiny_model(_spec(ctx, kind))
    return copy.deepcopy(ctx.reference_cache[key])


def _perturb(model: Any, seed: int = 1) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + FAULT_NOISE * torch.randn(p.shape, generator=gen))


def _backend(ctx: Context, model: Any, *, bf16: bool, distributed: bool = False) -> Any:
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    objective = ObjectiveConfig(
        mode="sc_mis", chunk_tokens=ctx.sizes.chunk_tokens, chunk_vocab=ctx.sizes.chunk_vocab
    )
    # no clipping: the gradients compared are the raw token-mean gradients
    optim = OptimConfig(learning_rate=LR, max_grad_norm=1e9)
    backend = HFBackend(
        model,
        objective,
        optim,
        device=ctx.device,
        distributed=distributed,
        max_tokens_per_micro_batch=ctx.sizes.max_tokens,
    )
    # The fp32 reference on a GPU: the backend's own switch (on a GPU it autocasts its forward to bf16)
    backend.bf16 = bf16 and ctx.on_gpu
    return backend


def _grads(backend: Any) -> dict[str, Any]:
    out = {}
    for name, p in backend.model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = g.detach().float().cpu()
    return out


def _params(backend: Any) -> dict[str, Any]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
        for name, p in backend.model.named_parameters()
    }


def _fp32_reference(ctx: Context, kind: str) -> dict[str, Any]:
    """The fp32 step on the device (once per model kind): loss, gradient norm, gradients."""
    key = f"reference/{kind}"
    if key not in ctx.reference_cache:
        flat = _flat_batch(ctx.sizes.step_lengths, _spec(ctx, kind).vocab_size, seed=0)
        backend = _backend(ctx, _model(ctx, kind), bf16=False)
        out, grad_norm = backend.train_step(flat, {"bench": 0})
        ctx.reference_cache[key] = {
            "flat": flat,
            "loss": float(out.loss),
            "grad_norm": grad_norm,
            "grads": _grads(backend),
        }
        del backend
        _empty_cache(ctx)
    return ctx.reference_cache[key]


def _empty_cache(ctx: Context) -> None:
    import gc

    import torch

    gc.collect()
    if ctx.on_gpu:
        torch.cuda.empty_cache()


def _compare_step(
    reference: dict[str, Any], loss: float, grad_norm: float, grads: dict[str, Any] | None
) -> Outcome:
    import torch

    tol = STEP_TOLERANCE
    measured: dict[str, Any] = {
        "loss": loss,
        "loss_fp32": reference["loss"],
        "grad_norm": grad_norm,
        "grad_norm_fp32": reference["grad_norm"],
    }
    loss_err = abs(loss - reference["loss"])
    measured["loss_abs_err"] = loss_err
    measured["grad_norm_rel_err"] = abs(grad_norm - reference["grad_norm"]) / max(
        reference["grad_norm"], 1e-30
    )
    bad = []
    if not loss_err <= tol["loss_abs"] + tol["loss_rel"] * abs(reference["loss"]):
        bad.append("loss")
    if not measured["grad_norm_rel_err"] <= tol["grad_norm_rel"]:
        bad.append("grad_norm")
    if grads is not None:
        names = sorted(reference["grads"])
        if sorted(grads) != names:
            bad.append("gradient names")
        else:
            cand = torch.cat([grads[n].reshape(-1) for n in names])
            ref = torch.cat([reference["grads"][n].reshape(-1) for n in names])
            measured["grad_rel_l2"] = _rel_l2(cand, ref)
            if not measured["grad_rel_l2"] <= tol["grad_rel_l2"]:
                bad.append("gradient")
    return Outcome(not bad, measured, dict(tol), f"outside tolerance: {', '.join(bad)}" if bad else "")


# ----------------------------------------------------------------------------------------------
# The checks.
# ----------------------------------------------------------------------------------------------


def check_torch_step(ctx: Context, name: str) -> Outcome:
    kind = name.split("/", 1)[1]
    reference = _fp32_reference(ctx, kind)
    model = _model(ctx, kind)
    if ctx.fault(name):
        _perturb(model)
    backend = _backend(ctx, model, bf16=True)
    out, grad_norm = backend.train_step(reference["flat"], {"bench": 0})
    outcome = _compare_step(reference, float(out.loss), grad_norm, _grads(backend))
    outcome.measured["bf16_autocast"] = backend.bf16
    outcome.measured["tokens"] = int(reference["flat"].num_tokens)
    return outcome


def _block_causal_reference(q: Any, k: Any, v: Any, sizes: list[int]) -> Any:
    """fp32 attention over the whole packed row with an explicit block-causal mask [L, L]."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    seq = torch.repeat_interleave(
        torch.arange(len(sizes), device=q.device), torch.tensor(sizes, device=q.device)
    )
    pos = torch.arange(q.shape[2], device=q.device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).float()


def check_attention(ctx: Context, name: str) -> Outcome:
    import torch

    from rlfleet.trainer.backends.attention import causal_attention_per_sequence

    a = ctx.sizes.attention
    sizes, length = a["sizes"], sum(a["sizes"])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, length, a["head_dim"], generator=gen)
        for h in (a["heads"], a["kv_heads"], a["kv_heads"])
    )
    q, k, v = (t.to(ctx.device).requires_grad_() for t in (q, k, v))
    probe = torch.randn(1, a["heads"], length, a["head_dim"], generator=gen).to(ctx.device)
    reference = _block_causal_reference(q, k, v, sizes)
    (reference * probe).sum().backward()
    ref_grads = [t.grad.detach().clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    q_in = q * 1.05 if ctx.fault(name) else q
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        out = causal_attention_per_sequence(q_in, k, v, sizes, scale=None)
    (out.float() * probe).sum().backward()
    measured: dict[str, Any] = {
        "dtype": str(out.dtype).removeprefix("torch."),
        "tokens": length,
        "sequences": len(sizes),
    }
    measured["out_rel_l2"] = _rel_l2(out.detach().float(), reference.detach())
    measured["grad_rel_l2"] = max(_rel_l2(t.grad, r) for t, r in zip((q, k, v), ref_grads, strict=True))
    # No leak: new keys and values for the LAST sequence change nobody else's output, to the bit.
    with torch.no_grad(), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        k2, v2 = k.detach().clone(), v.detach().clone()
        k2[:, :, -sizes[-1] :] += 1.0
        v2[:, :, -sizes[-1] :] -= 1.0
        before = causal_attention_per_sequence(q.detach(), k.detach(), v.detach(), sizes, scale=None)
        after = causal_attention_per_sequence(q.detach(), k2, v2, sizes, scale=None)
    measured["other_sequences_unchanged"] = bool(
        torch.equal(before[:, :, : -sizes[-1]], after[:, :, : -sizes[-1]])
    )
    bad = [key for key, limit in ATTENTION_TOLERANCE.items() if not measured[key] <= limit]
    if ctx.on_gpu and measured["dtype"] != "bfloat16":
        bad.append("attention did not run in bf16 under autocast")
    if not measured["other_sequences_unchanged"]:
        bad.append("a sequence's keys changed another sequence's output")
    return Outcome(not bad, measured, dict(ATTENTION_TOLERANCE), ", ".join(bad))


def check_routing(ctx: Context, name: str) -> Outcome:
    import torch

    from rlfleet.trainer.backends.routing_replay import moe_routers, replay_routing

    model = _model(ctx, "qwen3_moe").to(ctx.device).train()
    spec = _spec(ctx, "qwen3_moe")
    routers = moe_routers(model)
    length = 64
    ids = torch.randint(0, spec.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).to(
        ctx.device
    )
    # replayed experts: the experts the router ranks LAST (never its own top-k), on every other position
    with torch.no_grad():
        logits = model(input_ids=ids, output_router_logits=True, use_cache=False).router_logits
    experts = torch.stack([lg.float().argsort(dim=-1)[:, : spec.num_experts_per_tok] for lg in logits], dim=1)
    experts[1::2] = -1  # [positions, layers, top_k]; odd positions route as usual
    replayed = experts.clone()
    if ctx.fault(name):  # replay other experts than the ones the check expects (a shifted set is another set)
        replayed[0::2] = (replayed[0::2] + 1) % spec.num_experts
    routed: list[Any] = []
    with replay_routing(model, replayed), torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        # registered after the replay's own hooks: these see the index the experts are called with
        hooks = [r.register_forward_hook(lambda _m, _a, out: routed.append(out[2].detach())) for r in routers]
        try:
            out = model(input_ids=ids, use_cache=False)
            out.logits.float().logsumexp(-1).sum().backward()
        finally:
            for h in hooks:
                h.remove()
    got = torch.stack(routed, dim=1)  # [positions, layers, top_k] as the experts were called
    even = slice(0, None, 2)
    same = torch.equal(got[even].sort(-1).values, experts[even].sort(-1).values)
    gate_grads = [r.weight.grad for r in routers]
    finite = all(g is not None and bool(torch.isfinite(g).all()) for g in gate_grads)
    nonzero = all(g is not None and float(g.abs().sum()) > 0 for g in gate_grads)
    measured = {
        "replayed_positions": length // 2,
        "layers": len(routers),
        "routed_as_replayed": same,
        "router_grad_finite": finite,
        "router_grad_nonzero": nonzero,
        "logits_dtype": str(out.logits.dtype),
    }
    bad = [k for k in ("routed_as_replayed", "router_grad_finite", "router_grad_nonzero") if not measured[k]]
    return Outcome(not bad, measured, {"routed_as_replayed": True}, ", ".join(f"not {b}" for b in bad))


def check_fsdp2(ctx: Context, name: str) -> Outcome:
    import torch

    _ensure_process_group(ctx)
    reference = _fp32_reference(ctx, "qwen3")
    backend = _backend(ctx, _model(ctx, "qwen3"), bf16=True, distributed=True)
    if ctx.fault(name):  # an optimizer stepping with another lr than the configured one
        for group in backend.optimizer.param_groups:
            group["lr"] = LR * 1.01
    before = _params(backend)
    out, grad_norm = backend.train_step(reference["flat"], {"bench": 0})
    grads, after = _grads(backend), _params(backend)
    outcome = _compare_step(reference, float(out.loss), grad_norm, grads)
    # AdamW's first step (weight decay 0): m_hat = g, v_hat = g^2, so w1 = w0 - lr * g / (|g| + eps).
    worst = 0.0
    for n, w0 in before.items():
        g = grads[n].double()
        expected = w0.double() - LR * g / (g.abs() + ADAM_EPS)
        # fp32 arithmetic in the fused kernel: a few ulps of w
        slack = 2e-6 * torch.clamp(w0.double().abs(), min=1.0)
        worst = max(worst, float(((after[n].double() - expected).abs() / slack).max()))
    param = next(iter(backend.model.parameters()))
    outcome.measured |= {
        "fused": bool(backend.optimizer.defaults.get("fused")),
        "dtensor": hasattr(param, "full_tensor"),
        "param_device": str(getattr(param, "device", "")),
        "adam_update_err_over_slack": worst,
    }
    outcome.tolerance["adam_update"] = "|w1 - (w0 - lr g / (|g| + eps))| <= 2e-6 max(1, |w0|)"
    bad = [outcome.reason] if outcome.reason else []
    if worst > 1.0:
        bad.append("AdamW update differs from lr g / (|g| + eps)")
    if not (outcome.measured["fused"] and outcome.measured["dtensor"]):
        bad.append("not a fused AdamW over FSDP2 DTensors")
    outcome.held, outcome.reason = not bad, "; ".join(bad)
    return outcome


def _objective_inputs(ctx: Context, tokens: int) -> tuple[Any, Any, Any]:
    """Final hidden states [T, H] (bf16 on a GPU, as autocast gives them; fp32 on CPU), the fp32
    output embedding [V, H] and the batch's TokenBatch (support candidates)."""
    import torch

    from rlfleet.trainer.objective import TokenBatch

    s = ctx.sizes
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if ctx.on_gpu else torch.float32
    hidden = torch.randn(tokens, s.memory_hidden, generator=gen).to(ctx.device, dtype)
    weight = (torch.randn(s.memory_vocab, s.memory_hidden, generator=gen) * (2.0 / s.memory_hidden**0.5)).to(
        ctx.device
    )
    k = 8
    cand = torch.randint(0, s.memory_vocab, (tokens, k), generator=gen)
    logq = torch.log_softmax(torch.randn(tokens, k, generator=gen), dim=1)
    batch = TokenBatch(
        tokens=cand[:, 0].clone(),
        advantages=torch.randn(tokens, generator=gen),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        sampler_logprobs=logq[:, 0].clone(),
        candidate_ids=cand,
        candidate_logprobs=logq,
        candidates_are_support=True,
        group_ids=torch.zeros(tokens, dtype=torch.long),
        staleness=torch.zeros(tokens, dtype=torch.long),
    ).to(ctx.device)
    return hidden, weight, batch


@contextlib.contextmanager
def _peak_bytes(ctx: Context) -> Iterator[dict[str, int]]:
    """The extra bytes at the peak of the block: torch.cuda.max_memory_allocated above what was allocated
    before (on CPU: the peak resident set above the resident set before, /proc/self VmHWM)."""
    import torch

    box: dict[str, int] = {}
    _empty_cache(ctx)
    if ctx.on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield box
        torch.cuda.synchronize()
        box["bytes"] = torch.cuda.max_memory_allocated() - base
        return
    bench = _bench_objective()  # benchmarks/objective.py's reading of the peak resident set
    bench._reset_peak()  # VmHWM := the current resident set
    base = bench._status_kib("VmRSS")
    yield box
    box["bytes"] = (bench._status_kib("VmHWM") - base) * 1024


def _exact_cpu_peaks() -> None:
    """glibc serves large blocks from fresh mappings that a free returns, but raises that threshold
    (up to 32 MiB) after each such free, after which a block can reuse freed heap pages and leave no mark
    on the resident set: fix it at 64 KiB (M_MMAP_THRESHOLD, mallopt -3) so every tile and logits buffer
    of the CPU dry run shows in VmHWM."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 64 * 1024)


def _objective_step(ctx: Context, path: str, tokens: int) -> int | None:
    """Extra peak bytes of one forward + backward of the objective (`fused` or `materialized`); None
    when it ran out of GPU memory."""
    import torch

    from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

    hidden, weight, batch = _objective_inputs(ctx, tokens)
    cfg = ObjectiveConfig(
        mode="sc_mis", chunk_tokens=ctx.sizes.chunk_tokens, chunk_vocab=ctx.sizes.chunk_vocab
    )
    hidden.requires_grad_()
    weight.requires_grad_()
    try:
        with _peak_bytes(ctx) as peak:
            if path == "fused":
                out = policy_loss(hidden, weight, batch, cfg)
            else:
                with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.on_gpu):
                    logits = hidden @ weight.T  # [T, V]: what the lm_head gave before the fused objective
                out = _materialized().materialized_policy_loss(logits, batch, cfg)
            out.loss.backward()
            del out
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del hidden, weight, batch
        _empty_cache(ctx)
    return peak["bytes"]


def check_objective_memory(ctx: Context, name: str) -> Outcome:
    s = ctx.sizes
    tokens = s.memory_tokens[name]
    for path in (
        "fused",
        "materialized",
    ):  # warm-up: one-time buffers (cuBLAS workspace, thread pools) are no step's
        _objective_step(ctx, path, 64)
    # a fault runs the materialised objective where the fused one should be
    fused = _objective_step(ctx, "materialized" if ctx.fault(name) else "fused", tokens)
    materialized = _objective_step(ctx, "materialized", tokens)
    tile = s.chunk_tokens * s.chunk_vocab * 4
    bound = s.memory_vocab * s.memory_hidden * 4 + 2 * tokens * s.memory_hidden * 4 + 8 * tile + 64 * 2**20
    gib = 2.0**30
    measured = {
        "tokens": tokens,
        "vocab": s.memory_vocab,
        "hidden": s.memory_hidden,
        "fused_gib": None if fused is None else fused / gib,
        "materialized_gib": None if materialized is None else materialized / gib,
        "materialized_logits_gib": tokens * s.memory_vocab * (2 if ctx.on_gpu else 4) / gib,
        "measure": "torch.cuda.max_memory_allocated" if ctx.on_gpu else "VmHWM",
    }
    bad = []
    if fused is None or fused > bound:
        bad.append("fused objective above its bound")
    if fused is not None and materialized is not None and not fused * 2 <= materialized:
        bad.append("fused objective not under half the materialised one")
    tolerance = {"fused_bound_gib": bound / gib, "fused_over_materialized_max": 0.5}
    return Outcome(not bad, measured, tolerance, ", ".join(bad))


def check_megatron(ctx: Context, name: str) -> Outcome:
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise Skip(
            f"megatron-core is not importable ({e}): carry its wheel (scripts/gpu-check-wheels.txt)"
        ) from e
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_megatron import MegatronBackend, MegatronModelConfig
    from rlfleet.trainer.objective import ObjectiveConfig

    _ensure_process_group(ctx)
    reference = _fp32_reference(ctx, "qwen3")
    model = _model(ctx, "qwen3")
    if ctx.fault(name):
        _perturb(model)
    cfg = MegatronModelConfig.from_hf_config(
        model.config.to_dict(),
        device=ctx.device.type,
        params_dtype="bfloat16" if ctx.on_gpu else "float32",
        max_tokens_per_micro_batch=ctx.sizes.max_tokens,
    )
    objective = ObjectiveConfig(
        mode="sc_mis", chunk_tokens=ctx.sizes.chunk_tokens, chunk_vocab=ctx.sizes.chunk_vocab
    )
    backend = MegatronBackend(
        cfg,
        objective,
        OptimConfig(learning_rate=LR, max_grad_norm=1e9),
        initial_hf_weights={k: v.detach().clone() for k, v in model.state_dict().items()},
    )
    out, grad_norm = backend.train_step(reference["flat"], {"bench": 0})
    return _compare_step(reference, float(out.loss), float(grad_norm), None)


def _view_bound(view: str, w: Any, deq_scale: Any) -> Any:
    """Per element, the most a correct quantisation can be off w (the format's half step, see module doc)."""
    import torch

    if view == "fp8":
        return torch.maximum(w.abs() / 16, deq_scale / 1024) * (1 + 1e-4) + 1e-12
    x = w.abs() / torch.where(deq_scale > 0, deq_scale, 1.0)
    half = torch.where(x < 2, 0.25, torch.where(x < 4, 0.5, 1.0))
    return deq_scale * (half + (x - 6).clamp(min=0)) * (1 + 1e-4) + 1e-12


def _dequantize_on_device(
    view: str, tensors: dict[str, Any], base: str, device: Any, scale: float
) -> tuple[Any, Any]:
    """The view's stored tensors of one weight, dequantised on `device` -> (weight, the per-element scale)."""
    from rlfleet.numerics import formats

    q = tensors[f"{base}.weight"].to(device)
    if view == "fp8":
        s = tensors[f"{base}.weight_scale_inv"].to(device) * scale
        per_element = s.repeat_interleave(formats.FP8_BLOCK, 0).repeat_interleave(formats.FP8_BLOCK, 1)[
            : q.shape[0], : q.shape[1]
        ]
        return formats.dequantize_fp8_block(q, s), per_element
    ws, ws2 = tensors[f"{base}.weight_scale"].to(device), tensors[f"{base}.weight_scale_2"].to(device) * scale
    per_element = (ws.float() * ws2).repeat_interleave(formats.NVFP4_BLOCK, 1)
    return formats.dequantize_nvfp4(q, ws, ws2), per_element


def check_views(ctx: Context, name: str) -> Outcome:
    import torch

    from rlfleet.numerics import formats
    from rlfleet.numerics.views import view_tensors, view_weights

    view = name.split("/", 1)[1]
    state = {k: v.detach().to(torch.bfloat16) for k, v in _model(ctx, "qwen3").state_dict().items()}
    tensors, quantized = view_tensors(state, view)
    published = view_weights(state, view)  # the publisher's CPU dequantisation
    scale = 1.25 if ctx.fault(name) else 1.0
    worst, unequal, bytes_differ = 0.0, [], []
    for n in quantized:
        base = n[: -len(".weight")]
        w = state[n].to(ctx.device).float()
        deq, per_element = _dequantize_on_device(view, tensors, base, ctx.device, scale)
        if not torch.equal(deq.cpu(), published[n]):
            unequal.append(n)
        worst = max(worst, float(((deq - w).abs() / _view_bound(view, w, per_element)).max()))
        if view == "fp8":
            q, s = formats.quantize_fp8_block(w)
            if not (
                torch.equal(q.cpu().view(torch.uint8), tensors[n].view(torch.uint8))
                and torch.equal(s.cpu(), tensors[f"{base}.weight_scale_inv"])
            ):
                bytes_differ.append(n)
    measured = {
        "quantized_weights": len(quantized),
        "err_over_bound": worst,
        "unequal_to_cpu": unequal[:3],
        "device_quantization_differs": bytes_differ[:3],
    }
    bad = []
    if not quantized:
        bad.append("no quantized weight")
    if worst > 1.0:
        bad.append("an element outside its rounding bound")
    if unequal:
        bad.append("device dequantisation differs from the publisher's")
    if bytes_differ:
        bad.append("device quantisation differs from the published bytes")
    tolerance = {
        "err_over_bound_max": 1.0,
        "bound": "fp8: max(|w|/16, scale/1024); nvfp4: scale x half the E2M1 step",
    }
    return Outcome(not bad, measured, tolerance, ", ".join(bad))


CHECKS: dict[str, Callable[[Context, str], Outcome]] = {
    "torch_step/qwen3": check_torch_step,
    "torch_step/qwen3_moe": check_torch_step,
    "attention/varlen_bf16": check_attention,
    "routing/replay_bf16": check_routing,
    "fsdp2/fused_adamw": check_fsdp2,
    "objective/memory_16k": check_objective_memory,
    "objective/memory_64k": check_objective_memory,
    "megatron_step": check_megatron,
    "views/fp8": check_views,
    "views/nvfp4": check_views,
}


# ----------------------------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------------------------


def run_check(ctx: Context, name: str) -> dict[str, Any]:
    started = time.monotonic()
    line: dict[str, Any] = {"check": name, "device": str(ctx.device)}
    try:
        outcome = CHECKS[name](ctx, name)
        line |= {
            "status": "ok" if outcome.held else "failed",
            "measured": outcome.measured,
            "tolerance": outcome.tolerance,
            "reason": outcome.reason,
        }
    except Skip as skip:
        line |= {"status": "skipped", "reason": str(skip)}
    except Exception as e:  # a check that breaks has not held: its error is its reason
        last = traceback.extract_tb(e.__traceback__)[-1]
        line |= {
            "status": "failed",
            "reason": f"error: {type(e).__name__}: {e} ({Path(last.filename).name}:{last.lineno})",
        }
    line["seconds"] = round(time.monotonic() - started, 2)
    _empty_cache(ctx)
    return line


def _device(cpu: bool) -> Any:
    import torch

    if cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unavailable("no CUDA device (torch.cuda.is_available() is False); --cpu runs the dry run")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run: the same checks on CPU at small sizes")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument(
        "--fault", default="", help="comma-separated checks (or 'all') fed a deliberately wrong input"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = [n for n in names + [f for f in args.fault.split(",") if f and f != "all"] if n not in CHECKS]
    if unknown:
        print(f"gpu-check: unknown check {unknown[0]!r}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        import_product()
        import torch

        torch.set_float32_matmul_precision("highest")  # the fp32 reference is fp32, not TF32
        device = _device(args.cpu)
        if args.cpu:
            _exact_cpu_peaks()
    except ImportError as e:
        print(
            f"gpu-check: cannot import the product ({e}); carry the wheels of scripts/gpu-check-wheels.txt",
            file=sys.stderr,
        )
        return 2
    except Unavailable as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    counts = {"ok": 0, "failed": 0, "skipped": 0}
    failed = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(
            device=device,
            sizes=CPU_SIZES if args.cpu else GPU_SIZES,
            faults={f for f in args.fault.split(",") if f},
            work=Path(work),
        )
        for name in names:
            line = run_check(ctx, name)
            counts[line["status"]] += 1
            failed += [name] if line["status"] == "failed" else []
            print(json.dumps(line), flush=True)
    summary = {
        "summary": counts,
        "device": str(device),
        "seconds": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
        "failed": failed,
    }
    print(json.dumps(summary), flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
