"""The megatron CPU tier for a mixture of experts: the REAL megatron-core 0.19.2 GPTModel with MoE
layers (megatron's TopKRouter, SequentialMLP experts, the alltoall token dispatcher), built by our
backend (device "cpu", gloo), against transformers 5.19's Qwen3-MoE on tiny checkpoints made here with
the project's builder (`rlfleet.tiny_qwen3.tiny_model`, `architecture="qwen3_moe"`, 4 experts, top-2)
and `save_pretrained`.

Runs under .venv312 as `python megatron_moe_cpu_checks.py OUT.json`; tests/trainer/test_trainer_megatron.py
launches it and asserts on the JSON ({"checks": {name: {"ok": bool, ...}}, "wall_s": float}). Phase 1
runs in this process (world 1: EP=1); phase 2 spawns 2 processes (EP=2: two experts per rank, tokens
dispatched between the ranks by alltoall over gloo). The stubs are megatron_cpu_checks.py's (the
product's CPU shims), and so are the helpers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron_cpu_checks import (
    GROUPS,
    SIZES,
    VOCAB,
    against_transformers,
    build,
    drive,
    flat_batch,
    full_logits,
    gather_to_rank_0,
    input_scales_unequal,
    join_group,
    leave_group,
    logits_close,
    publish_version_0_views,
    restore_report,
    restore_then_step,
    run_tier,
    shift_norms,
    token_ids,
)
from megatron_cpu_checks import (
    compare_steps as compare_dense_steps,
)
from megatron_cpu_checks import (
    roundtrip as export_roundtrip,
)

VARIANTS = {
    # Qwen3-MoE's released configs: top-k weights renormalised (megatron: softmax of the top-k logits)
    "moe_norm_topk_prob": dict(norm_topk_prob=True),
    # transformers' default: the top-k softmax probabilities as they are (megatron: pre-softmax router)
    "moe_plain_topk_prob": dict(norm_topk_prob=False),
}
# the load-balancing loss on, at a coefficient that moves the gradient well beyond the tolerances
AUX = dict(norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.5)


def make_checkpoint(
    directory: Path,
    norm_topk_prob: bool,
    seed: int = 0,
    output_router_logits: bool = False,
    router_aux_loss_coef: float = 0.001,
) -> Path:
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

    spec = TinyQwen3(
        architecture="qwen3_moe",
        **SIZES,
        head_dim=12,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=norm_topk_prob,
        seed=seed,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    model = tiny_model(spec)
    shift_norms(model, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(directory)
    return directory


def checkpoint_names(directory: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under checkpoint names (experts one by one)."""
    from safetensors.torch import load_file

    from rlfleet.numerics.views import checkpoint_tensors

    return checkpoint_tensors(load_file(str(directory / "model.safetensors")))


def roundtrip(backend, directory: Path) -> dict[str, Any]:
    """The export against the checkpoint's names (experts one by one): 2 layers x 4 experts x 3 linears."""
    report = export_roundtrip(backend, directory, checkpoint_names)
    if not report:  # not rank 0
        return report
    experts = sorted(k for k in checkpoint_names(directory) if ".mlp.experts." in k)
    return report | {"ok": report["ok"] and len(experts) == 2 * 4 * 3, "expert_tensors": len(experts)}


RAGGED = [
    12,
    3,
    9,
    5,
    7,
    2,
    10,
]  # tokens per sequence: at EP=2 (two data-parallel ranks) 3 packed micro-batches and 1


def with_routing(flat):
    """`flat` with the samplers' experts of each row (2 layers, top-2 of the 4 experts, drawn at random:
    a layer's set equals the trainer's about one time in six), every fifth row without routing (-1:
    not compared)."""
    from dataclasses import replace

    rng = np.random.default_rng(3)
    rows = len(flat.row_seq)
    routed = np.stack([np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(rows)]).astype(
        np.int64
    )
    routed[::5] = -1
    return replace(flat, routed_experts=routed)


ROUTING_KEYS = ("routing_mismatch_tokens", "routing_mismatch_layers", "routing_tokens")


def routing_of(out) -> dict[str, Any]:
    """The routing mismatch metrics of a step, whole batch and per group."""
    whole = {k: out.metrics[k] for k in ROUTING_KEYS if k in out.metrics}
    groups = {str(g): {k: m[k] for k in ROUTING_KEYS if k in m} for g, m in sorted(out.per_group.items())}
    return {"batch": whole, "groups": groups}


def same_routing(got: dict[str, Any], want: dict[str, Any]) -> bool:
    """Equal routing metrics: the same compared-token counts and means (merged over data-parallel
    ranks they are token-weighted means of the ranks' means: equal to the last bits)."""

    def close(a: dict[str, float], b: dict[str, float]) -> bool:
        return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-12 for k in a)

    return (
        close(got["batch"], want["batch"])
        and set(got["groups"]) == set(want["groups"])
        and all(close(got["groups"][g], want["groups"][g]) for g in want["groups"])
    )


def step(backend, flat=None) -> dict[str, Any]:
    out, grad_norm = backend.train_step(flat if flat is not None else flat_batch(7), GROUPS)
    return {
        "loss": float(out.loss),
        "grad_norm": grad_norm,
        "kl_k3": out.metrics["kl_k3"],
        "tokens": out.num_valid_tokens,
        "weights": backend.weights(),
        "routing": routing_of(out),
    }


def compare_steps(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """The dense tier's step comparison, and the same routing metrics."""
    report = compare_dense_steps(got, want)
    return report | {
        "ok": report["ok"] and same_routing(got["routing"], want["routing"]),
        "num_valid_tokens": got["tokens"],
        "routing": got["routing"]["batch"],
    }


def publish_version_0(backend, directory: Path, work: Path) -> dict[str, Any]:
    """What `rlfleet trainer run` does before step 1 (run_training -> ChannelSink -> WeightPublisher,
    steps=0) with the MoE backend, bf16 + nvfp4 views: version 0 is published, every linear of the
    model (attention, each expert's gate/up/down; not the router, which stays unquantized) is quantized
    in the nvfp4 view, and each one's input_scale is amax / (448 * 6) with the amax transformers'
    Qwen3-MoE of the checkpoint gives (`calibrate_activation_amax`: experts over every token entering
    the block) on the same calibration batch: exact."""
    from transformers import AutoModelForCausalLM

    from rlfleet.numerics.views import calibrate_activation_amax, calibration_batch

    try:
        latest, config, tensors = publish_version_0_views(backend, directory, work)
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    reference = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32
    )  # = version 0 (the export is exact)
    amax = calibrate_activation_amax(reference, [calibration_batch(VOCAB)])
    modules = [n[: -len(".weight")] for n in config["quantized"]]
    unequal = input_scales_unequal(modules, tensors, amax)
    experts = [m for m in modules if ".mlp.experts." in m]
    return {
        "ok": latest is not None
        and latest.version == 0
        and not unequal
        and set(modules) == set(amax) - {"lm_head"}
        and len(experts) == 2 * 4 * 3
        and not any(m.endswith("mlp.gate") for m in modules),
        "version": None if latest is None else latest.version,
        "quantized": len(modules),
        "expert_linears": len(experts),
        "unequal": unequal[:5],
        "calibrated": len(amax),
    }


# --------------------------------------------------------------------------- phase 1: EP=1


def phase_ep1(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    checks: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for name, directory, backend, _, theirs, match in against_transformers(work, VARIANTS, make_checkpoint):
        checks[f"moe_logits_match_transformers_ep1[{name}]"] = match
        checks[f"moe_hf_export_roundtrip_ep1[{name}]"] = roundtrip(backend, directory)
        if name == "moe_norm_topk_prob":
            checks[f"moe_publish_version_0_nvfp4[{name}]"] = publish_version_0(
                backend, directory, work / "publish"
            )
        refs[f"hf_logits[{name}]"] = theirs
    refs["step"] = step(build(work / "moe_norm_topk_prob", tp=1), with_routing(flat_batch(11, lens=RAGGED)))
    checks["moe_router_aux_step_equals_transformers_backend"], refs["aux_step"] = aux_checks(work)
    return checks, refs


def hf_backend_step(directory: Path, flat) -> tuple[float, float, dict[str, Any]]:
    """The reference: the transformers backend's step (its load-balancing term is tested against a
    hand-written one in tests/trainer/test_trainer_backend_hf.py) at the same micro-batch budget."""
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    backend = HFBackend.from_pretrained(
        directory,
        ObjectiveConfig(mode="sc_mis", replay=True),
        optim=OptimConfig(learning_rate=1e-2),
        device="cpu",
        distributed=False,
        max_tokens_per_micro_batch=2 * 7,
    )
    out, grad_norm = backend.train_step(flat, GROUPS)
    return float(out.loss), grad_norm, routing_of(out)


def aux_checks(work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3-MoE with output_router_logits and router_aux_loss_coef 0.5: the megatron step (two packed
    micro-batches) gives the transformers backend's loss and gradient norm (load-balancing term
    included), and the same weights without the term give another gradient norm (the term is on)."""
    directory = make_checkpoint(work / "moe_aux", **AUX)
    plain = make_checkpoint(work / "moe_aux_off", **{**AUX, "output_router_logits": False})
    flat = with_routing(flat_batch(7))
    want_loss, want_norm, want_routing = hf_backend_step(directory, flat)
    ours = step(build(directory, tp=1), flat)
    off = step(build(plain, tp=1), flat)
    dl, dg = abs(ours["loss"] - want_loss), abs(ours["grad_norm"] - want_norm)
    term = abs(ours["grad_norm"] - off["grad_norm"])
    # one 7-token sequence per micro-batch: under TP=2 each row gets a padding token (counted out)
    odd_rows = step(build(directory, tp=1, max_tokens_per_micro_batch=7), flat)
    # activation recompute: each layer's forward (router, dispatch, experts) re-run in backward
    recompute = compare_steps(step(build(directory, tp=1, activation_checkpointing=True), flat), ours)
    return (
        {
            "ok": dl <= 1e-6
            and dg <= 1e-5
            and term > 1e-3
            and recompute["ok"]
            and ours["routing"] == want_routing,
            "loss_diff": dl,
            "grad_norm_diff": dg,
            "grad_norm": ours["grad_norm"],
            "grad_norm_without_aux": off["grad_norm"],
            "aux_grad_norm_effect": term,
            "activation_checkpointing": recompute,
            "routing": ours["routing"]["batch"],
            "transformers_routing": want_routing["batch"],
            "routing_groups": sorted(ours["routing"]["groups"]),
        },
        odd_rows,
    )


# --------------------------------------------------------------------------- phase 2: EP=2


def phase_ep2(rank: int, port: int, work: str, refs_path: str, out_path: str) -> None:
    refs = join_group(rank, 2, port, refs_path)
    work_dir = Path(work)
    checks: dict[str, Any] = {}
    ids = token_ids(1)
    for name in VARIANTS:
        backend = build(work_dir / name, tp=1, expert_parallel=2)
        checks[f"moe_logits_match_transformers_ep2[{name}]"] = logits_close(
            full_logits(backend, ids), refs[f"hf_logits[{name}]"]
        ) | {"local_experts": len(backend.model.module.decoder.layers[0].mlp.experts.local_experts)}
        result = drive(backend, rank, lambda b, name=name: roundtrip(b, work_dir / name))
        if rank == 0:
            checks[f"moe_hf_export_roundtrip_ep2[{name}]"] = result
    backend = build(work_dir / "moe_norm_topk_prob", tp=1, expert_parallel=2)
    result = drive(backend, rank, lambda b: step(b, with_routing(flat_batch(11, lens=RAGGED))))
    if rank == 0:
        checks["moe_ep2_step_equals_ep1"] = compare_steps(result, refs["step"])
    checks["moe_ep2_restore_then_step_equals_uninterrupted_all_ranks"] = restore_check(rank, work_dir)
    checks["moe_ep2_checkpoint_refused_at_ep1"] = other_layout_refused(rank, work_dir)
    # TP=2 with sequence parallel (one data-parallel replica: the same micro-batches as TP=1): each rank
    # routes half of each packed row of 7 tokens + 1 padding token (counted out); load-balancing term on
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()  # one layout per process otherwise (the backend refuses a change)
    backend = build(work_dir / "moe_aux", tp=2, max_tokens_per_micro_batch=7)
    result = drive(backend, rank, lambda b: step(b, with_routing(flat_batch(7))))
    if rank == 0:
        checks["moe_router_aux_tp2_sequence_parallel_step_equals_tp1"] = compare_steps(
            result, refs["aux_step"]
        )
    leave_group(rank, checks, out_path)


def restore_check(rank: int, work_dir: Path) -> dict[str, Any] | None:
    """EP=2: save -> restore -> one step == uninterrupted, on every rank (its experts, the optimizer
    state of the dense and the expert parameters: megatron chains one distributed optimizer for each),
    bf16 with the load-balancing term on. Run B starts from other weights (another seed), so everything
    it ends with must come from the restore."""
    run_a = build(work_dir / "moe_aux", tp=1, dtype="bfloat16", expert_parallel=2)
    expected, before, got = restore_then_step(
        rank,
        work_dir / "ckpt-ep2",
        run_a,
        lambda: build(work_dir / "moe_aux_other_init", tp=1, dtype="bfloat16", expert_parallel=2),
    )
    local = restore_report(expected, before, got)
    experts = [
        k for k in got if k.startswith("model.") and ".local_experts." in k and "_extra_state" not in k
    ]
    local["ok"] = local["ok"] and bool(experts)
    local["expert_tensors"] = len(experts)
    local["expert_tensors_changed_by_restore"] = sum(not torch.equal(before[k], got[k]) for k in experts)
    return gather_to_rank_0(rank, local)


def phase_tp2_ep2(rank: int, port: int, work: str, refs_path: str, out_path: str) -> None:
    """Four processes, TP=2 x EP=2 with whole experts (expert TP 1): attention and the vocabulary split
    over TP pairs, each rank 2 of the 4 experts, two data-parallel replicas of the dense part and two
    of the experts. (Expert TP = TP = 2 with EP = 2 does not run on gloo: megatron's alltoall dispatcher
    all-gathers each expert's tokens over the expert-TP ranks in unequal parts, which gloo's allgather
    refuses; NCCL takes them.)"""
    refs = join_group(rank, 4, port, refs_path)
    work_dir = Path(work)
    checks: dict[str, Any] = {}
    name = "moe_norm_topk_prob"
    layout = dict(tp=2, expert_parallel=2, expert_tensor_parallel=1)
    backend = build(work_dir / name, **layout)
    mlp = backend.model.module.decoder.layers[0].mlp
    checks[f"moe_logits_match_transformers_tp2_ep2[{name}]"] = logits_close(
        full_logits(backend, token_ids(1)), refs[f"hf_logits[{name}]"]
    ) | {
        "local_experts": len(mlp.experts.local_experts),
        "expert_fc1_rows": mlp.experts.local_experts[0].linear_fc1.weight.shape[0],
        "qkv_rows": backend.model.module.decoder.layers[0].self_attention.linear_qkv.weight.shape[0],
    }
    result = drive(backend, rank, lambda b: roundtrip(b, work_dir / name))
    if rank == 0:
        checks[f"moe_hf_export_roundtrip_tp2_ep2[{name}]"] = result
    backend = build(work_dir / name, **layout)
    result = drive(backend, rank, lambda b: step(b, with_routing(flat_batch(11, lens=RAGGED))))
    if rank == 0:
        checks["moe_tp2_ep2_step_equals_ep1"] = compare_steps(result, refs["step"])
    leave_group(rank, checks, out_path)


def other_layout_refused(rank: int, work_dir: Path) -> dict[str, Any] | None:
    """The EP=2 checkpoint in an EP=1 run of the same world (two data-parallel replicas): the ranks'
    `local_experts.{0,1}` would be other experts, so the restore is refused, naming both layouts."""
    from megatron.core import parallel_state

    from rlfleet.trainer.publish import checkpoint

    parallel_state.destroy_model_parallel()
    backend = build(work_dir / "moe_aux_other_init", tp=1, dtype="bfloat16")

    def load(b) -> str:
        try:
            b.load_state_dict(checkpoint.load_latest(work_dir / "ckpt-ep2")["backend"])
        except ValueError as exc:
            return str(exc)
        return ""

    error = drive(backend, rank, load)
    parallel_state.destroy_model_parallel()
    if rank != 0:
        return None
    return {
        "ok": "'ep': 2" in error
        and "'ep': 1" in error
        and "resharding a checkpoint is not supported" in error,
        "error": error[:400],
    }


def other_init(work: Path) -> None:
    """The restore check's run B starts from other weights (another seed)."""
    make_checkpoint(work / "moe_aux_other_init", **AUX, seed=1)


if __name__ == "__main__":
    sys.exit(run_tier(sys.argv[1], phase_ep1, other_init, [(phase_ep2, 2), (phase_tp2_ep2, 4)]))
