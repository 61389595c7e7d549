"""LoRA on the torch backend (trainer/backends/backend_hf.py + trainer/backends/lora.py, RLJob `trainer.lora`,
docs/weights.md "LoRA"), on the project's tiny Qwen3 and Qwen3-MoE, fp32 on CPU. PEFT itself is the oracle:

- the optimizer holds the adapter only, the base is frozen and a step leaves it bit-identical to the
  checkpoint; every adapter tensor moves;
- `weights()` is the adapter alone, named and shaped as PEFT's own `get_peft_model_state_dict` of a PEFT
  model built here from the checkpoint; written as the `lora` view's files (adapter_model.safetensors +
  rlfleet.lora's adapter_config.json) it loads with `PeftModel.from_pretrained` and gives the trained
  backend's logits;
- checkpoints hold the adapter and its optimizer state only; 2 steps, checkpoint, a fresh backend on the
  same base + load, 1 step == 3 uninterrupted steps bitwise, in 1 process and on 2 FSDP2 gloo ranks
  (which also match 1 process);
- refusals: MLP targets on a mixture of experts, a target the model lacks, lora with megatron;
- `resolve_run` carries `trainer.lora` (local and cluster).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from support.hf_backend_steps import GROUPS, SMALL_MOE, SMALL_QWEN3, cpu_backend, make_batch, spawn
from transformers import AutoModelForCausalLM

from rlfleet.api.lora_spec import LORA_BACKEND_MESSAGE, LoraSpec
from rlfleet.api.rljob import MAX_TOKENS_PER_MICRO_BATCH
from rlfleet.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, TARGET_MODULES, adapter_config
from rlfleet.trainer.backends.backend_hf import HFBackend
from rlfleet.trainer.publish.checkpoint import load_checkpoint_file
from rlfleet.trainer.rollout.batching import plan_micro_batches

ALL_TARGETS = LoraSpec(rank=4, alpha=8.0, target_modules=list(TARGET_MODULES))
ATTENTION = LoraSpec(rank=4, alpha=8.0)  # the default targets: q_proj, k_proj, v_proj, o_proj
TWO_RANK_ATOL = (
    1e-5  # 2 ranks vs 1 process: the reduce-scatter's summation order (test_trainer_backend_hf.py)
)


def reference_peft(ckpt: Path, spec: LoraSpec) -> PeftModel:
    """PEFT's own model of `spec` on the checkpoint, unsharded: the names and shapes the backend must give."""
    base = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
    )
    return get_peft_model(base, config)


def base_name(name: str) -> str:
    """The checkpoint's name of a PEFT-wrapped base parameter (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


@pytest.mark.parametrize(
    "model, spec", [(SMALL_QWEN3, ALL_TARGETS), (SMALL_MOE, ATTENTION)], ids=["dense-all-7", "moe-attention"]
)
def test_only_the_adapter_trains_and_weights_are_peft_s_adapter_state_dict(
    tmp_path: Path, tiny_qwen3_factory, model: dict, spec: LoraSpec
) -> None:
    ckpt = tiny_qwen3_factory(**model)
    backend = cpu_backend(ckpt, lora=spec)
    before = backend.weights()
    for seed in (1, 2):
        backend.train_step(make_batch(seed=seed), GROUPS)

    # The optimizer holds exactly the adapter's parameters; the base is frozen and bit-identical to the checkpoint.
    optimized = {id(p) for group in backend.optimizer.param_groups for p in group["params"]}
    named = dict(backend.model.named_parameters())
    adapter = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    assert adapter and {n for n, p in named.items() if id(p) in optimized} == adapter
    assert {n for n, p in named.items() if p.requires_grad} == adapter
    base = dict(AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).named_parameters())
    frozen = {base_name(n): p for n, p in named.items() if n not in adapter}
    assert frozen.keys() == base.keys()
    for name, p in frozen.items():
        assert torch.equal(p, base[name]), name

    # weights(): PEFT's own adapter state dict of an unsharded PEFT model (names, shapes), nothing else.
    reference = reference_peft(ckpt, spec)
    want = get_peft_model_state_dict(reference)
    got = backend.weights()
    assert {k: tuple(v.shape) for k, v in got.items()} == {k: tuple(v.shape) for k, v in want.items()}
    modules = {k.split(".")[-3] for k in got}
    assert modules == set(spec.target_modules)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in got
    assert got["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (spec.rank, 32)
    for name, t in got.items():
        assert t.device.type == "cpu" and t.dtype == torch.float32, name
        assert not torch.equal(t, before[name]), f"{name} was not trained"

    # The lora view's layout loads with PEFT and gives the trained backend's logits (not the base's).
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    save_file(got, str(adapter_dir / ADAPTER_WEIGHTS_FILE))
    settings = adapter_config(
        rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=spec.target_modules
    )
    (adapter_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(settings))
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32), str(adapter_dir)
    ).eval()
    untouched = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    backend.model.eval()
    flat = make_batch(seed=5)
    # One row per forward, as the backend packs (its attention takes one packed row).
    for row, length in zip(flat.input_ids[:3], flat.seq_lens[:3], strict=True):
        ids = torch.from_numpy(row[:length])[None]
        with torch.no_grad():
            trained = backend.model(input_ids=ids, use_cache=False).logits
            served = loaded(input_ids=ids, use_cache=False).logits
            base_logits = untouched(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(served, trained, rtol=0, atol=1e-6)
        assert float((trained - base_logits).abs().max()) > 1e-3  # the adapter changes the model


def test_the_backend_s_lora_settings_are_rlfleet_s_adapter_config(tiny_qwen3_factory) -> None:
    """What the backend trains with is what the published adapter_config.json says (rlfleet.lora)."""
    spec = LoraSpec(rank=8, alpha=4.0, dropout=0.25, target_modules=["o_proj", "down_proj", "q_proj"])
    backend = cpu_backend(tiny_qwen3_factory(**SMALL_QWEN3), lora=spec)
    assert backend.peft is not None
    trained = backend.peft.peft_config["default"].to_dict()
    published = adapter_config(
        rank=spec.rank, alpha=spec.alpha, dropout=spec.dropout, target_modules=spec.target_modules
    )
    for key in ("r", "lora_alpha", "lora_dropout", "bias", "fan_in_fan_out", "use_rslora", "use_dora"):
        assert trained[key] == published[key], key
    assert sorted(trained["target_modules"]) == published["target_modules"]


def test_mlp_targets_on_a_mixture_of_experts_are_refused_in_one_line(tiny_qwen3_factory) -> None:
    ckpt = tiny_qwen3_factory(**SMALL_MOE)
    for targets in (["up_proj"], ["q_proj", "gate_proj", "down_proj"]):
        with pytest.raises(ValueError) as refused:
            cpu_backend(ckpt, lora=LoraSpec(target_modules=targets))
        message = str(refused.value)
        assert "\n" not in message
        assert "gate_proj/up_proj/down_proj are its experts" in message
        assert (
            "SGLang 0.5.23 loads expert adapters only in its own fused layout: use attention targets"
            in message
        )
        assert all(t in message for t in targets if t != "q_proj")


def test_a_target_the_model_lacks_is_refused_with_its_module_list(tiny_qwen3_factory) -> None:
    # The API allows only the seven Qwen3 names; a spec built past validation stands for another model's names.
    spec = LoraSpec.model_construct(rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError) as refused:
        cpu_backend(tiny_qwen3_factory(**SMALL_QWEN3), lora=spec)
    message = str(refused.value)
    assert "\n" not in message and "['qkv_proj']" in message
    for module in TARGET_MODULES:
        assert module in message


# --- what the step saves for backward -----------------------------------------------------------


def saved_for_backward(backend: HFBackend, flat: Any) -> dict[str, int]:
    """What autograd saves for backward during one train step (one micro-batch here), by the innermost module
    running when it was saved ('' outside every module: the objective): the bytes of each storage saved,
    counted once (q/k/v share one saved input), parameters left out (they are held anyway). Deterministic:
    the same graph saves the same tensors; no allocator, no RSS."""
    running: list[str] = []

    def leave(*_: Any) -> None:  # returns None: the module's output stays its own
        running.pop()

    hooks = []
    for name, module in backend.model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda *_, n=name: running.append(n)))
        hooks.append(module.register_forward_hook(leave))
    held = {p.untyped_storage().data_ptr() for p in backend.model.parameters()}
    seen: set[int] = set()
    saved: dict[str, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            where = running[-1] if running else ""
            saved[where] = saved.get(where, 0) + storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            backend.train_step(flat, GROUPS)
    finally:
        for hook in hooks:
            hook.remove()
    return saved


def test_lora_saves_no_more_for_backward_than_full_fine_tuning(tiny_qwen3_factory) -> None:
    """LoRA's step keeps no more activations than full fine-tuning's on the same micro-batch (docs/benchmarks.md
    "LoRA": the benchmark's 1.74x larger step RSS is the allocator and its baseline, not tensors): a frozen
    linear saves nothing for a weight gradient, lora_A saves the input the full linear would (the same
    storage, no cast, no dropout mask at the default dropout 0), lora_B its [T, r] input; a frozen RMSNorm
    saves less. With activation checkpointing on, nothing inside a decoder layer is saved under LoRA either
    (checkpointing is engaged: PEFT's layers need no enable_input_require_grads with the non-reentrant one)."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    flat = make_batch(seed=1)
    full = saved_for_backward(cpu_backend(ckpt), flat)
    lora_all = saved_for_backward(cpu_backend(ckpt, lora=ALL_TARGETS), flat)
    lora_attention = saved_for_backward(cpu_backend(ckpt, lora=ATTENTION), flat)
    assert sum(lora_attention.values()) < sum(lora_all.values()) < sum(full.values())
    # Each lora_A saves exactly what the full linear saves (its input, the same storage: k_proj and v_proj
    # add nothing after q_proj, up_proj nothing after gate_proj; a cast or a dropout would save a copy per
    # target), each lora_B its [T, r] input, each frozen base layer nothing.
    (micro_batch,) = plan_micro_batches(flat, np.arange(len(flat.seq_lens)), MAX_TOKENS_PER_MICRO_BATCH)
    tokens = len(micro_batch.packed(flat)[0])  # each sequence cut after its last sampled token
    for layer in range(SMALL_QWEN3["num_hidden_layers"]):
        for target in TARGET_MODULES:
            block = "self_attn" if target in ATTENTION.target_modules else "mlp"
            module = f"model.layers.{layer}.{block}.{target}"
            assert lora_all.get(f"{module}.lora_A.default", 0) == full.get(module, 0), module
            assert lora_all[f"{module}.lora_B.default"] == tokens * ALL_TARGETS.rank * 4, module
            assert f"{module}.base_layer" not in lora_all and module not in lora_all, module
    assert full[""] == lora_all[""] == lora_attention[""]  # the objective: the same tiles either way

    checkpointed = saved_for_backward(
        cpu_backend(ckpt, lora=ALL_TARGETS, activation_checkpointing=True), flat
    )
    assert not [where for where in checkpointed if ".layers." in where], checkpointed
    assert sum(checkpointed.values()) < sum(lora_all.values())


# --- checkpoint and resume ----------------------------------------------------------------------


def _shards(backend: HFBackend) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's own shard of every trained parameter and of its Adam moments, read from the live state."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in backend.model.named_parameters():
        if p.requires_grad:
            state = backend.optimizer.state[p]
            local = {"param": p, **{k: state[k] for k in ("exp_avg", "exp_avg_sq", "step")}}
            out[name] = {
                k: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for k, t in local.items()
            }
    return out


def _resume_job(rank: int, ckpt: str, spec: LoraSpec, out_dir: str) -> dict[str, Any]:
    """Steps 1 and 2, `state_dict()` (rank 0 writes it, as trainer/publish/checkpoint.py does; read back
    weights-only as a resume does), then step 3 twice: uninterrupted, and on a FRESH backend from the same
    base checkpoint that loaded it (rank 0 the file, the other ranks what their own state_dict() gave).
    One process (rank 0, no process group) runs the same job."""
    distributed = torch.distributed.is_initialized()
    batches = [make_batch(seed=s) for s in (1, 2, 3)]
    uninterrupted = cpu_backend(ckpt, lora=spec)
    losses = [float(uninterrupted.train_step(b, GROUPS)[0].loss) for b in batches[:2]]
    state = uninterrupted.state_dict()  # a collective: every rank calls it
    path = Path(out_dir) / "trainer-ckpt.pt"
    if rank == 0:
        torch.save(state, path)
    if distributed:
        torch.distributed.barrier()
    saved = load_checkpoint_file(path)
    resumed = cpu_backend(ckpt, lora=spec)
    resumed.load_state_dict(saved if rank == 0 else state)
    loaded = _shards(resumed)
    after_step_2 = _shards(uninterrupted)
    runs = {}
    for how, backend in (("uninterrupted", uninterrupted), ("resumed", resumed)):
        loss = float(backend.train_step(batches[2], GROUPS)[0].loss)
        runs[how] = {"loss": loss, "weights": backend.weights(), "shards": _shards(backend)}
    return {
        "losses": losses,
        "checkpoint": {"model": sorted(saved["model"]), "optimizer": saved["optimizer"]},
        "trainable": sorted(n for n, p in uninterrupted.model.named_parameters() if p.requires_grad),
        "after_step_2": after_step_2,
        "loaded": loaded,
        **runs,
    }


def assert_resume_is_bitwise(result: dict, where: str) -> None:
    # The checkpoint holds the adapter (this backend's trained parameters) and its optimizer state only.
    assert result["checkpoint"]["model"] == result["trainable"], where
    assert all(".lora_A." in n or ".lora_B." in n for n in result["checkpoint"]["model"]), where
    optimizer_state = result["checkpoint"]["optimizer"]["state"]
    assert len(optimizer_state) == len(result["trainable"]), where
    for name, want in result["after_step_2"].items():
        assert float(want["step"]) == 2.0, where
        for key, t in want.items():
            assert torch.equal(result["loaded"][name][key], t), f"{where}: loaded {name} {key}"
    want, got = result["uninterrupted"], result["resumed"]
    assert got["loss"] == want["loss"], where
    assert got["weights"].keys() == want["weights"].keys(), where
    for name, t in want["weights"].items():
        assert torch.equal(got["weights"][name], t), f"{where}: {name}"
    for name, tensors in want["shards"].items():
        assert float(tensors["step"]) == 3.0, where
        for key, t in tensors.items():
            assert torch.equal(got["shards"][name][key], t), f"{where}: {name} {key}"


@pytest.mark.parametrize("model", [SMALL_QWEN3, SMALL_MOE], ids=["dense", "moe"])
def test_one_process_resume_equals_three_uninterrupted_steps(
    tmp_path: Path, tiny_qwen3_factory, model: dict
) -> None:
    spec = ALL_TARGETS if model is SMALL_QWEN3 else ATTENTION
    result = _resume_job(0, str(tiny_qwen3_factory(**model)), spec, str(tmp_path))
    assert_resume_is_bitwise(result, "1 process")


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~20 s on 2 shared cores: two spawned processes import torch + transformers + peft
def test_fsdp2_lora_on_two_gloo_ranks_resumes_bitwise_and_matches_one_process(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    """Two FSDP2 ranks: the adapter is sharded (the ranks hold different halves), the checkpoint saved by
    rank 0 restores every rank's shards and step 3 equals the uninterrupted one bitwise; the run equals one
    process's (losses 1e-6, weights to the summation-order tolerance); rank 1's `weights()` is empty."""
    ckpt = str(tiny_qwen3_factory(**SMALL_QWEN3))
    ranks = spawn(tmp_path / "multi", _resume_job, ckpt, ALL_TARGETS, str(tmp_path / "multi"))
    single = _resume_job(0, ckpt, ALL_TARGETS, str(tmp_path))
    assert_resume_is_bitwise(ranks[0], "rank 0 of 2")
    for how in ("uninterrupted", "resumed"):
        assert ranks[1][how]["weights"] == {}
    multi = ranks[0]["uninterrupted"]
    for got, want in zip(
        ranks[0]["losses"] + [multi["loss"]],
        single["losses"] + [single["uninterrupted"]["loss"]],
        strict=True,
    ):
        assert abs(got - want) < 1e-6
    assert multi["weights"].keys() == single["uninterrupted"]["weights"].keys()
    for name, w in single["uninterrupted"]["weights"].items():
        torch.testing.assert_close(multi["weights"][name], w, rtol=0, atol=TWO_RANK_ATOL, msg=name)
    # Rank 1 restored its own shards too, bitwise.
    for name, want in ranks[1]["after_step_2"].items():
        for key, t in want.items():
            assert torch.equal(ranks[1]["loaded"][name][key], t), f"rank 1 loaded {name} {key}"
    for name, tensors in ranks[1]["uninterrupted"]["shards"].items():
        for key, t in tensors.items():
            assert torch.equal(ranks[1]["resumed"]["shards"][name][key], t), f"rank 1 {name} {key}"
    # Sharded, not replicated: lora_A [r, in] is split over the ranks along r.
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    halves = [r["uninterrupted"]["shards"][name]["param"] for r in ranks]
    assert halves[0].shape[0] + halves[1].shape[0] == ALL_TARGETS.rank
    assert not torch.equal(halves[0], halves[1])


def test_a_full_weights_checkpoint_is_refused_by_a_lora_backend(tmp_path: Path, tiny_qwen3_factory) -> None:
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    full = cpu_backend(ckpt).state_dict()
    with pytest.raises(ValueError, match="not a checkpoint of this LoRA adapter"):
        cpu_backend(ckpt, lora=ATTENTION).load_state_dict(full)


# --- the run's configuration --------------------------------------------------------------------


def _job_with_lora(tmp_path: Path, lora: dict[str, Any]) -> Any:
    from rlfleet.api import load_rljob
    from rlfleet.yamlfile import read_yaml

    doc = read_yaml(Path(__file__).resolve().parents[2] / "examples" / "rljob.yaml")
    doc["spec"]["trainer"]["backend"] = "torch"
    doc["spec"]["trainer"].pop("parallelism", None)
    doc["spec"]["trainer"]["lora"] = lora
    path = tmp_path / "rljob.yaml"
    path.write_text(json.dumps(doc))
    return load_rljob(path)


def test_resolve_run_carries_trainer_lora_in_local_and_cluster_mode(tmp_path: Path) -> None:
    from rlfleet.trainer.config import resolve_run

    job = _job_with_lora(tmp_path, {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"]})
    for local in (True, False):
        rc = resolve_run(job, local=local)
        assert rc.lora == LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]), local
        dumped = json.loads(json.dumps(rc.as_json()))
        assert dumped["lora"]["targetModules"] == ["q_proj", "v_proj"] and dumped["lora"]["rank"] == 8


def test_build_backend_refuses_lora_with_megatron_and_trains_it_with_torch(
    tiny_qwen3_factory, example_run
) -> None:
    from rlfleet.trainer.run import TrainingStartError, build_backend

    source = tiny_qwen3_factory(**SMALL_QWEN3)
    rc = example_run(lora=ATTENTION)
    with pytest.raises(TrainingStartError) as refused:
        build_backend(rc, backend="megatron", source_dir=source, device="cpu")
    assert str(refused.value) == LORA_BACKEND_MESSAGE and "\n" not in LORA_BACKEND_MESSAGE
    base = build_backend(rc, backend="torch", source_dir=source, device="cpu")
    assert isinstance(base.backend, HFBackend) and base.backend.lora == ATTENTION
    assert {n.split(".")[-3] for n in base.backend.weights()} == set(ATTENTION.target_modules)
