"""The megatron CPU tier: the REAL megatron-core 0.19.2 GPTModel, built by our backend
(`rlfleet.trainer.backends.backend_megatron.MegatronBackend`, device "cpu", gloo), against transformers 5.19's
Qwen3 on tiny checkpoints made here with `Qwen3Config` + `save_pretrained`.

Runs under .venv312 (CPython 3.12; scripts/bootstrap) as `python megatron_cpu_checks.py OUT.json`;
tests/trainer/test_trainer_megatron.py (the main suite, Python 3.11) launches it and asserts on the
JSON it writes: {"checks": {name: {"ok": bool, ...numbers}}, "wall_s": float}. Phase 1 runs in this
process (world size 1, TP=1; it also publishes version 0 as `rlfleet trainer run` does, nvfp4 view
included); phase 2 spawns 2 processes (TP=2, sequence parallel, gloo); phase 3
spawns 4 (TP=2 x DP=2: two data-parallel replicas, the distributed optimizer sharded over them).

Stubs, only for CUDA-only calls that megatron-core makes unconditionally (nothing else is replaced); they
are the product's (`rlfleet.trainer.backends.megatron_cpu.install_cpu_shims`, which a trainer on the cpu class runs):
- `CudaDevicesOnCpu` (a TorchFunctionMode): tensors megatron creates with `device="cuda"` /
  `torch.cuda.current_device()` (the schedule's token counter, the optimizer's found-inf and scale
  tensors, grad-norm buffers) are created on the CPU instead; `Tensor.cuda()` is the identity;
  `Tensor.type()` answers `torch.cuda.*Tensor` (the distributed optimizer dispatches on that string).
- `torch.cuda.current_device` returns the CPU device (no CUDA runtime to ask; also where autograd
  runs backward outside the mode above); `torch.cuda.current_stream`
  returns a stream object whose waits do nothing (the gradient buffer waits on CUDA-graph events,
  of which there are none; CPU work is synchronous).
- `CudaRNGStatesTracker.fork` is a null context: the CUDA RNG tracker forks CUDA RNG states around
  dropout; dropout is 0 here (as in the backend) so no random number is drawn.
- activation recompute (the `activation_checkpointing` check): megatron's `_get_cuda_rng_state` /
  `_set_cuda_rng_state` use the CPU generator's state / do nothing, and the recomputing backward runs
  under `CudaDevicesOnCpu`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: tests/, for support/
    sys.path.append(str(Path(__file__).resolve().parents[1]))
from support.ports import free_port  # noqa: E402 - tests/, put on sys.path just above

VOCAB = 64
SIZES: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
"""The tiny checkpoints' sizes (Hugging Face config fields), the dense ones' and the MoE tier's."""
SEQ = 7  # odd: sequence parallel over TP=2 needs the backend's padding
# Updated weights after one Adam step (lr 1e-2) against another layout or micro-batching: the
# gradients differ in the last bits (other summation orders), and Adam's first step lr g / (|g| + eps)
# turns that into up to 1.6e-5 on an element whose gradient is within a few eps (1e-8) of zero. 1e-4 is
# 1e-2 of the step; a wrong shard, a missed micro-batch or a mis-scaled gradient is >= lr off.
UPDATE_ATOL = 1e-4


def install_stubs() -> contextlib.AbstractContextManager:
    """The product's CPU shims (trainer/backends/megatron_cpu.py), the same ones a cpu-class trainer runs."""
    from rlfleet.trainer.backends.megatron_cpu import install_cpu_shims

    return install_cpu_shims()


# --------------------------------------------------------------------------- checkpoints

VARIANTS = {
    # Qwen3 as transformers 5 writes it: QK-norm, head_dim (12) != hidden/heads (8), rope_parameters
    "qwen3_head_dim_rope_parameters": dict(head_dim=12, tie_word_embeddings=False, legacy_rope=False),
    # the same written as transformers 4 did: top-level rope_theta
    "qwen3_rope_theta": dict(head_dim=12, tie_word_embeddings=False, legacy_rope=True),
    # tied embeddings (no lm_head tensor in the checkpoint), the default head_dim
    "qwen3_tied": dict(head_dim=8, tie_word_embeddings=True, legacy_rope=False),
}


def make_checkpoint(directory: Path, head_dim: int, tie_word_embeddings: bool, legacy_rope: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        **SIZES,
        head_dim=head_dim,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    shift_norms(model)
    model.save_pretrained(directory)
    if legacy_rope:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        data["rope_theta"] = data.pop("rope_parameters")["rope_theta"]
        path.write_text(json.dumps(data))
    return directory


def shift_norms(model: torch.nn.Module, generator: torch.Generator | None = None) -> None:
    """Norm weights + N(0, 0.3^2) noise (from `generator`, else torch's global one), away from 1 so a
    missing or mis-mapped norm shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits of the checkpoint (its config.json's architecture), fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def build(directory: Path, tp: int, dtype: str = "float32", **config: Any):
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_megatron import MegatronBackend, MegatronModelConfig
    from rlfleet.trainer.objective import ObjectiveConfig

    hf_cfg = json.loads((directory / "config.json").read_text())
    # two sequences of the odd-length batch (7 tokens each) per micro-batch unless told otherwise
    config = {"max_tokens_per_micro_batch": 2 * SEQ} | config
    cfg = MegatronModelConfig.from_hf_config(
        hf_cfg, tensor_parallel=tp, params_dtype=dtype, device="cpu", **config
    )
    return MegatronBackend(
        cfg,
        ObjectiveConfig(mode="sc_mis", replay=True),
        OptimConfig(learning_rate=1e-2),
        initial_hf_weights=hf_tensors(directory),
    )


def full_logits(backend, ids: torch.Tensor) -> torch.Tensor:
    """The GPTModel's logits (its final hidden states times the output weight) with the vocabulary
    shards all-gathered over the TP group."""
    from megatron.core import parallel_state as ps

    module = backend.model.module
    with torch.no_grad():
        # the backend's GPTModel returns the output layer's input (the objective is the fused lm_head):
        # project it onto this rank's vocabulary shard here
        hidden = module(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
        weight = (
            module.shared_embedding_or_output_weight()
            if backend.cfg.tie_word_embeddings
            else module.output_layer.weight
        )
        local = hidden @ weight.T
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return local
    shards = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(shards, dim=-1)


def flat_batch(seed: int, lens: list[int] | None = None):
    """Sequences of SEQ + 1 tokens whose rows are logit positions 0..SEQ-1: the backend forwards SEQ
    (odd) tokens of each (cut after the last sampled one). `lens`: ragged sequences of these token
    counts instead (rows through each one's last token)."""
    from rlfleet.trainer.rollout.batching import FlatBatch

    rng = np.random.default_rng(seed)
    lens = lens or [SEQ + 1] * 4
    b, k = len(lens), 4
    row_seq = np.concatenate([np.full(n - 1, i) for i, n in enumerate(lens)])
    row_pos = np.concatenate([np.arange(n - 1) for n in lens])
    t = len(row_seq)
    cand = np.stack([rng.permutation(VOCAB)[:k] for _ in range(t)])
    lq = np.log(rng.dirichlet(np.ones(k), size=t)).astype(np.float32)
    return FlatBatch(
        input_ids=rng.integers(0, VOCAB, size=(b, max(lens))),
        seq_lens=np.array(lens),
        row_seq=row_seq,
        row_pos=row_pos,
        target_ids=cand[:, 0],
        advantages=rng.normal(size=t).astype(np.float32),
        logq=lq[:, 0].copy(),
        logq_support=lq[:, 0].copy(),
        cand_offsets=np.arange(t + 1) * k,
        cand_ids=cand.reshape(-1),
        cand_logq=lq.reshape(-1),
        candidate_mode="support",
        versions=np.zeros(t, dtype=np.int64),
        staleness=np.zeros(t, dtype=np.int64),
        groups=np.array(["a", "b"] * t, dtype=object)[:t],
        rollout_uids=[f"u{i}" for i in range(b)],
    )


GROUPS = {"a": 0, "b": 1}


def token_ids(seed: int) -> torch.Tensor:
    """Logit checks call the GPTModel directly (no backend padding): an even length."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, VOCAB, size=(2, SEQ + 1)))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def logits_close(ours: torch.Tensor, want: torch.Tensor) -> dict[str, Any]:
    """Logits equal to 1e-5 (fp32: other kernels, other summation orders)."""
    d = max_diff(ours, want)
    return {"ok": d <= 1e-5, "max_abs_diff": d}


def roundtrip(
    backend, directory: Path, original_of: Callable[[Path], dict[str, torch.Tensor]] = hf_tensors
) -> dict[str, Any]:
    """The backend's export (every rank takes part) against the checkpoint's tensors as `original_of`
    reads them: the same names, each bit-equal. Rank 0's verdict; {} on the others."""
    exported = backend.weights()
    if torch.distributed.get_rank() != 0:
        return {}
    original = original_of(directory)
    bad = sorted(k for k in original if k not in exported or not torch.equal(exported[k], original[k]))
    return {
        "ok": set(exported) == set(original) and not bad,
        "names": len(original),
        "extra": sorted(set(exported) - set(original)),
        "unequal": bad[:10],
    }


def local_state(backend) -> dict[str, torch.Tensor]:
    """This rank's model shard and its optimizer parameter state (main params, Adam moments)."""
    out = {
        f"model.{k}": v.detach().clone()
        for k, v in backend.model.module.state_dict().items()
        if isinstance(v, torch.Tensor)
    }
    for i, opt in enumerate(
        backend.optimizer.chained_optimizers
        if hasattr(backend.optimizer, "chained_optimizers")
        else [backend.optimizer]
    ):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"main.{i}.{g}.{j}"] = p.detach().clone()
                for key, val in opt.optimizer.state.get(p, {}).items():
                    if isinstance(val, torch.Tensor):
                        out[f"state.{i}.{g}.{j}.{key}"] = val.detach().clone()
    return out


def publish_version_0_views(backend, directory: Path, work: Path) -> tuple[Any, dict[str, Any], dict]:
    """What `rlfleet trainer run` does before step 1 (trainer/run.py `run_training`: `ChannelSink` ->
    `WeightPublisher`, steps=0) with `backend` into a filesystem channel under `work` with the bf16 and
    nvfp4 views of `directory`'s checkpoint: the channel's latest version, and the config and tensors of
    version 0's nvfp4 view."""
    from dataclasses import replace

    from rlfleet.api import load_rljob
    from rlfleet.numerics.views import read_view_tensors
    from rlfleet.store import open_store
    from rlfleet.trainer.collapse import CollapseDetector
    from rlfleet.trainer.config import GroupSpec, resolve_run
    from rlfleet.trainer.publish.publisher import WeightPublisher
    from rlfleet.trainer.run import ChannelSink, run_training

    class NoRollouts:  # steps=0: the loop takes no rollout (the entrypoint test's stand-in)
        next_position = 0

        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

    channel_dir = work / "channel"
    channel_dir.mkdir(parents=True)
    publisher = WeightPublisher(
        open_store(str(channel_dir)),
        views=["bf16", "nvfp4"],
        follow_subscribers=False,
        base_checkpoint=directory,
    )
    example = resolve_run(
        load_rljob(Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml"), local=True
    )
    rc = replace(
        example,
        steps=0,
        prompts_per_step=1,
        max_staleness=None,
        groups=[GroupSpec("h100-bf16", "h100", "bf16"), GroupSpec("b200-nvfp4", "b200", "nvfp4")],
    )
    run_training(
        rc,
        backend,
        ChannelSink(publisher),
        CollapseDetector(),
        lambda position: NoRollouts(),
        checkpoint=None,
    )
    config, tensors = read_view_tensors(publisher.channel.obtain_view(0, "nvfp4", work / "nvfp4").directory)
    return publisher.channel.latest(), config, tensors


def input_scales_unequal(modules: list[str], tensors: dict[str, torch.Tensor], amax: dict) -> list[str]:
    """The quantized linears of an nvfp4 view whose input_scale is missing or not amax / (448 * 6)."""
    from rlfleet.numerics import formats

    return [
        m
        for m in modules
        if f"{m}.input_scale" not in tensors
        or not torch.equal(tensors[f"{m}.input_scale"], formats.nvfp4_global_scale(amax[m]))
    ]


def publish_version_0(backend, directory: Path, work: Path) -> dict[str, Any]:
    """What `rlfleet trainer run` does before step 1 with this backend (trainer/run.py `run_training`:
    `ChannelSink` -> `WeightPublisher`, steps=0) into a filesystem channel with the bf16 and nvfp4
    views: version 0 is published and its nvfp4 view gives every quantized linear an `input_scale`
    equal to amax / (448 * 6), amax from `calibrate_activation_amax` on the same calibration batch
    run by transformers' Qwen3 loaded (`from_pretrained` + `load_state_dict`) with the weights the
    backend exports, in their dtype: exact."""
    from transformers import Qwen3ForCausalLM

    from rlfleet.numerics.views import calibrate_activation_amax, calibration_batch

    t0 = time.monotonic()
    try:
        latest, config, tensors = publish_version_0_views(backend, directory, work)
    except Exception as exc:  # the bug this pins: GPTModel called with token ids only, or no amax
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    publish_s = time.monotonic() - t0
    weights = backend.weights()
    dtype = weights["model.embed_tokens.weight"].dtype
    reference = Qwen3ForCausalLM.from_pretrained(directory, dtype=dtype)
    missing, unexpected = reference.load_state_dict(weights, strict=False)  # tied: lm_head is embed_tokens
    amax = calibrate_activation_amax(reference, [calibration_batch(VOCAB)])
    modules = [n[: -len(".weight")] for n in config["quantized"]]
    unequal = input_scales_unequal(modules, tensors, amax)
    linears = {
        n for n, mod in reference.named_modules() if isinstance(mod, torch.nn.Linear) and n != "lm_head"
    }
    return {
        "ok": latest is not None
        and latest.version == 0
        and set(modules) == linears
        and not unequal
        and not unexpected
        and set(missing) <= {"lm_head.weight"},
        "version": None if latest is None else latest.version,
        "dtype": str(dtype).removeprefix("torch."),
        "quantized": len(modules),
        "linears": len(linears),
        "unequal": unequal[:5],
        "publish_s": publish_s,
        "amax_range": [min(amax[m] for m in modules), max(amax[m] for m in modules)],
    }


# --------------------------------------------------------------------------- phase 1: TP=1


def against_transformers(
    work: Path, variants: dict[str, dict[str, Any]], make: Callable[..., Path]
) -> Iterator[tuple[str, Path, Any, torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """Each variant's checkpoint made under `work` by `make`, a TP=1 backend of it, our logits of
    token_ids(1), transformers' and how they compare (with the logits' scale): (name, directory,
    backend, ours, theirs, match)."""
    ids = token_ids(1)
    for name, variant in variants.items():
        directory = make(work / name, **variant)
        backend = build(directory, tp=1)
        ours, theirs = full_logits(backend, ids), hf_logits(directory, ids)
        match = logits_close(ours, theirs) | {"logit_scale": float(theirs.abs().max())}
        yield name, directory, backend, ours, theirs, match


def phase_tp1(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    checks: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for name, directory, backend, ours, _, match in against_transformers(work, VARIANTS, make_checkpoint):
        checks[f"logits_match_transformers[{name}]"] = match
        checks[f"hf_export_roundtrip_tp1[{name}]"] = roundtrip(backend, directory)
        checks[f"publish_version_0_nvfp4[{name}]"] = publish_version_0(
            backend, directory, work / "publish" / name
        )
        refs[f"logits[{name}]"] = ours
    # the trainer's own precision (params_dtype bfloat16; the norms stay fp32): calibrated in bf16
    tied = work / "qwen3_tied"
    checks["publish_version_0_nvfp4_bf16[qwen3_tied]"] = publish_version_0(
        build(tied, tp=1, dtype="bfloat16"), tied, work / "publish" / "bf16"
    )
    # the odd-length step at TP=1 (no sequence parallel): the reference for TP=2 + SP
    backend = build(work / "qwen3_head_dim_rope_parameters", tp=1)
    out, grad_norm = backend.train_step(flat_batch(7), GROUPS)
    refs["odd_loss"], refs["odd_grad_norm"] = float(out.loss), grad_norm
    refs["odd_kl_k3"], refs["odd_tokens"] = out.metrics["kl_k3"], out.num_valid_tokens
    refs["odd_weights"] = backend.weights()
    checks.update(token_budget_checks(work / "qwen3_head_dim_rope_parameters"))
    return checks, refs


RAGGED = [12, 3, 9, 5, 7, 2, 10]  # tokens per sequence: a long-tailed batch


def hf_step(directory: Path, flat) -> tuple[float, float]:
    """The reference by hand on transformers' Qwen3: one padded forward of the whole batch, the
    objective on its rows' final hidden states and lm_head, backward of the token-mean loss: (loss,
    gradient norm)."""
    from transformers import AutoModelForCausalLM

    from rlfleet.trainer.backends.backend_common import to_token_batch
    from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    hidden = model.model(input_ids=torch.from_numpy(flat.input_ids), use_cache=False).last_hidden_state
    rows = hidden[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]
    out = policy_loss(
        rows,
        model.get_output_embeddings().weight,
        to_token_batch(flat, GROUPS),
        ObjectiveConfig(mode="sc_mis", replay=True),
    )
    out.loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(out.loss), float(norm)


def compare_steps(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Two steps ({"loss", "grad_norm", "kl_k3", "tokens", "weights"}) the same: loss and kl_k3 to 1e-6,
    the gradient norm to 1e-5, every updated weight to UPDATE_ATOL, the same token count and weights."""
    wd = max(max_diff(got["weights"][k], want["weights"][k]) for k in want["weights"])
    dl, dg, dk = (
        abs(got["loss"] - want["loss"]),
        abs(got["grad_norm"] - want["grad_norm"]),
        abs(got["kl_k3"] - want["kl_k3"]),
    )
    return {
        "ok": dl <= 1e-6
        and dg <= 1e-5
        and dk <= 1e-6
        and wd <= UPDATE_ATOL
        and got["tokens"] == want["tokens"]
        and set(got["weights"]) == set(want["weights"]),
        "loss_diff": dl,
        "grad_norm_diff": dg,
        "kl_k3_diff": dk,
        "updated_weights_max_diff": wd,
    }


def token_budget_checks(directory: Path) -> dict[str, Any]:
    """A ragged batch at a budget of 14 tokens (several packed micro-batches: THD rows of sequences back
    to back) against one micro-batch of the whole batch and against transformers' one padded forward;
    and activation checkpointing (megatron's full recompute) against the same step without it."""
    flat = flat_batch(11, lens=RAGGED)
    want_loss, want_norm = hf_step(directory, flat)
    from rlfleet.trainer.backends.megatron_packed import PackedDotProductAttention

    runs = {}
    rows_seen: list[list[int]] = []  # the sequence lengths of each packed row the attention took
    plain_forward = PackedDotProductAttention.forward

    def watched(self, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            rows_seen.append(torch.diff(packed_seq_params.cu_seqlens_q).tolist())
        return plain_forward(self, *args, packed_seq_params=packed_seq_params, **kwargs)

    PackedDotProductAttention.forward = watched
    try:
        for name, config in {
            "one_micro_batch": {"max_tokens_per_micro_batch": 1 << 14},
            "budget_14": {"max_tokens_per_micro_batch": 14},
            "budget_14_recompute": {"max_tokens_per_micro_batch": 14, "activation_checkpointing": True},
        }.items():
            backend = build(directory, tp=1, **config)
            rows_seen.clear()
            out, grad_norm = backend.train_step(flat, GROUPS)
            runs[name] = {
                "loss": float(out.loss),
                "grad_norm": grad_norm,
                "kl_k3": out.metrics["kl_k3"],
                "tokens": out.num_valid_tokens,
                "weights": backend.weights(),
                "recompute": backend.tconfig.recompute_granularity,
                "rows": [list(r) for r in rows_seen],
            }
    finally:
        PackedDotProductAttention.forward = plain_forward
    one, small, recompute = runs["one_micro_batch"], runs["budget_14"], runs["budget_14_recompute"]
    budget = compare_steps(small, one)
    budget["transformers_loss_diff"] = abs(small["loss"] - want_loss)
    budget["transformers_grad_norm_diff"] = abs(small["grad_norm"] - want_norm)
    budget["ok"] = (
        budget["ok"]
        and budget["transformers_loss_diff"] <= 1e-5
        and budget["transformers_grad_norm_diff"] <= 1e-4
    )
    budget["tokens"] = small["tokens"]
    budget["packed_rows"] = small[
        "rows"
    ]  # per attention call (2 layers, forward and backward recompute none)
    ckpt = compare_steps(recompute, small)
    ckpt["ok"] = ckpt["ok"] and recompute["recompute"] == "full" and small["recompute"] is None
    return {
        "token_budget_micro_batches_equal_one_micro_batch": budget,
        "activation_checkpointing_step_equals_plain": ckpt,
    }


# --------------------------------------------------------------------------- phase 2: TP=2


def drive(backend, rank: int, script) -> Any:
    """As in production: global rank 0 runs `script` (its calls broadcast commands), every other
    rank executes them in `follow()` until rank 0 closes."""
    if rank != 0:
        backend.follow()
        return None
    try:
        return script(backend)
    finally:
        backend.close()


def join_group(rank: int, world: int, port: int, refs_path: str) -> dict[str, Any]:
    """A spawned process: torchrun's environment (the backend initialises the gloo group), the stubs;
    the references phase 1 saved at `refs_path`."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    install_stubs()
    return torch.load(refs_path, weights_only=False)


def leave_group(rank: int, checks: dict[str, Any], out_path: str) -> None:
    if rank == 0:
        Path(out_path).write_text(json.dumps(checks, default=str))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def step_equals_reference(backend, rank: int, refs: dict[str, Any]) -> dict[str, Any] | None:
    """One train_step on the odd-length batch + publish, against the single-process run: loss,
    kl_k3, token count (the whole batch's), grad norm and every updated weight."""
    result = drive(backend, rank, lambda b: (b.train_step(flat_batch(7), GROUPS), b.weights()))
    if rank != 0:
        return None
    (out, grad_norm), weights = result
    wd = max(max_diff(weights[k], refs["odd_weights"][k]) for k in weights)
    dl, dg = abs(float(out.loss) - refs["odd_loss"]), abs(grad_norm - refs["odd_grad_norm"])
    dk = abs(out.metrics["kl_k3"] - refs["odd_kl_k3"])
    return {
        "ok": dl <= 1e-6
        and dg <= 1e-5
        and wd <= UPDATE_ATOL
        and dk <= 1e-6
        and out.num_valid_tokens == refs["odd_tokens"],
        "seq_len": SEQ,
        "loss_diff": dl,
        "grad_norm_diff": dg,
        "kl_k3_diff": dk,
        "updated_weights_max_diff": wd,
        "num_valid_tokens": out.num_valid_tokens,
        "loss": float(out.loss),
    }


def phase_tp2(rank: int, port: int, work: str, refs_path: str, out_path: str) -> None:
    refs = join_group(rank, 2, port, refs_path)
    work_dir = Path(work)
    checks: dict[str, Any] = {}
    ids = token_ids(1)
    for name in VARIANTS:
        backend = build(work_dir / name, tp=2)
        checks[f"tp2_logits_equal_tp1[{name}]"] = logits_close(
            full_logits(backend, ids), refs[f"logits[{name}]"]
        )
        result = drive(backend, rank, lambda b, name=name: roundtrip(b, work_dir / name))
        if rank == 0:
            checks[f"hf_export_roundtrip_tp2[{name}]"] = result

    # odd sequence length, TP=2 with sequence parallel: padded, same loss / grad norm / update as TP=1
    backend = build(work_dir / "qwen3_head_dim_rope_parameters", tp=2)
    assert backend.tconfig.sequence_parallel
    checks["odd_seq_sequence_parallel_tp2_equals_tp1"] = step_equals_reference(backend, rank, refs)
    checks["restore_then_step_equals_uninterrupted_all_ranks"] = restore_check(rank, work_dir, tp=2)
    leave_group(rank, checks, out_path)


def restore_check(rank: int, work_dir: Path, tp: int) -> dict[str, Any] | None:
    """save -> restore -> one step == uninterrupted, on every rank, bf16 (separate fp32 main params).
    Run B starts from OTHER weights, so everything it ends with must come from the restore."""
    directory = work_dir / f"ckpt-{tp}-{torch.distributed.get_world_size()}"
    run_a = build(work_dir / "qwen3_head_dim_rope_parameters", tp=tp, dtype="bfloat16")
    expected, before, got = restore_then_step(
        rank, directory, run_a, lambda: build(work_dir / "other_init", tp=tp, dtype="bfloat16")
    )
    return gather_to_rank_0(rank, restore_report(expected, before, got))


def restore_then_step(
    rank: int, directory: Path, run_a, build_run_b: Callable[[], Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run A steps, saves to `directory` through the loop's checkpoint files (saved, verified and unpickled
    weights-only: no allowlist entry) and steps again; run B, built after it from other weights, restores
    that checkpoint and takes the same second step. This rank's state (`local_state`) of A at the end,
    of B before the restore and of B at the end."""
    from rlfleet.trainer.publish import checkpoint

    def uninterrupted(b):
        b.train_step(flat_batch(11), GROUPS)
        checkpoint.save_checkpoint(directory, {"step": 1, "backend": b.state_dict()})
        b.train_step(flat_batch(12), GROUPS)

    def restored(b):
        b.load_state_dict(checkpoint.load_latest(directory)["backend"])
        b.train_step(flat_batch(12), GROUPS)

    drive(run_a, rank, uninterrupted)
    expected = local_state(run_a)
    run_b = build_run_b()
    before = local_state(run_b)
    drive(run_b, rank, restored)
    return expected, before, local_state(run_b)


def restore_report(
    expected: dict[str, torch.Tensor], before: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """One rank's verdict: every tensor of the restored run equals the uninterrupted one's, Adam moments
    among them."""
    unequal = sorted(k for k in expected if not torch.equal(expected[k], got[k]))
    moments = [k for k in expected if k.endswith(("exp_avg", "exp_avg_sq"))]
    return {
        "ok": not unequal and bool(moments) and set(expected) == set(got),
        "tensors": len(expected),
        "adam_moment_tensors": len(moments),
        "n_unequal": len(unequal),
        "unequal": unequal[:10],
        "unequal_max_diff": max([max_diff(expected[k], got[k]) for k in unequal], default=0.0),
        "model_tensors_changed_by_restore": sum(
            not torch.equal(before[k], got[k]) for k in got if k.startswith("model.")
        ),
    }


def gather_to_rank_0(rank: int, local: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's verdict, on rank 0 (None elsewhere): ok when all are."""
    world = torch.distributed.get_world_size()
    parts: list[Any] | None = [None] * world if rank == 0 else None
    torch.distributed.gather_object(local, parts, dst=0)
    return {"ok": parts is not None and all(p["ok"] for p in parts), "per_rank": parts} if rank == 0 else None


def phase_tp2_dp2(rank: int, port: int, work: str, refs_path: str, out_path: str) -> None:
    """Four processes, TP=2 x DP=2 (the production shape): each replica trains on half the sequences;
    the gradient, the update and the loss rank 0 reports are the whole batch's, and a restore with
    the optimizer state sharded over the replicas is exact on every rank."""
    refs = join_group(rank, 4, port, refs_path)
    work_dir = Path(work)
    checks: dict[str, Any] = {}
    backend = build(work_dir / "qwen3_head_dim_rope_parameters", tp=2)
    checks["tp2_dp2_step_equals_single_process"] = step_equals_reference(backend, rank, refs)
    checks["tp2_dp2_restore_then_step_equals_uninterrupted_all_ranks"] = restore_check(rank, work_dir, tp=2)
    leave_group(rank, checks, out_path)


def run_tier(
    out: str,
    phase_1: Callable[[Path], tuple[dict[str, Any], dict[str, Any]]],
    run_b_weights: Callable[[Path], None],
    spawned: list[tuple[Callable[..., None], int]],
) -> int:
    """A tier: `phase_1` in this process (world size 1) gives checks and the references the spawned
    phases compare against; `run_b_weights` writes where the restore checks' run B starts; each spawned
    phase runs in its number of processes, `phase(rank, port, work, refs_path, out_path)`. Writes the
    JSON the main suite reads to `out`; exit status 0 when every check is ok."""
    t0 = time.monotonic()
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    install_stubs()
    with tempfile.TemporaryDirectory(prefix="rlfleet-mg-cpu-") as tmp:
        work = Path(tmp)
        checks, refs = phase_1(work)
        run_b_weights(work)
        torch.save(refs, work / "refs.pt")
        torch.distributed.destroy_process_group()
        t1 = time.monotonic()
        import torch.multiprocessing as mp

        for phase, processes in spawned:
            phase_out = work / f"{phase.__name__}.json"
            mp.spawn(
                phase,
                args=(free_port(), str(work), str(work / "refs.pt"), str(phase_out)),
                nprocs=processes,
                join=True,
            )
            checks.update(json.loads(phase_out.read_text()))
    Path(out).write_text(
        json.dumps(
            {
                "checks": checks,
                "wall_s": time.monotonic() - t0,
                "phase_1_s": t1 - t0,
                "spawned_s": time.monotonic() - t1,
            },
            indent=1,
            default=str,
        )
    )
    return 0 if all(c.get("ok") for c in checks.values()) else 1


def other_init(work: Path) -> None:
    """Run B of the restore check starts from other weights of the same shapes."""
    from safetensors.torch import save_file

    source, other_dir = work / "qwen3_head_dim_rope_parameters", work / "other_init"
    other_dir.mkdir()
    (other_dir / "config.json").write_text((source / "config.json").read_text())
    save_file(
        {k: torch.randn_like(v) * 0.1 for k, v in hf_tensors(source).items()},
        str(other_dir / "model.safetensors"),
    )


if __name__ == "__main__":
    sys.exit(run_tier(sys.argv[1], phase_tp1, other_init, [(phase_tp2, 2), (phase_tp2_dp2, 4)]))
