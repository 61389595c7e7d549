"""The `hf` backend (trainer/backends/backend_hf.py) on real transformers models saved as real HF checkpoints
(the project's tiny Qwen3, rlfleet/tiny_qwen3.py at small sizes, and a Llama built from its config),
fp32 on CPU.

- one process: the loss equals the objective on the model's full logits (the `logits_to_keep` row
  gather is exact), for Qwen3 and Llama;
- FSDP2 (`fully_shard`) over 2 gloo processes on CPU: the same loss, the same gradients after the
  reduce-scatter and the same updated weights as one process, to 1e-6; also where gloo's reduce-scatter
  sums when asked to average, as torch 2.6's does (emulated here on the newer torch);
- restore: a checkpoint taken after step 1 (saved by rank 0) restores a fresh backend on every rank,
  weights and Adam moments, and step 2 equals the uninterrupted run bitwise (1 and 2 processes);
- rank 0 drives, rank 1 only runs `follow()` (the trainer entrypoint's protocol, shared with the
  megatron backend): the same losses and weights as one process, and `follow()` returns at `close()`;
  under a real `torchrun` (2 CPU ranks) the backend joins the process group torchrun describes;
- `weights()` carries exactly the HF checkpoint's parameter names.
No stubs: real models, real torch.distributed (gloo, a file:// rendezvous).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from support.hf_backend_steps import (
    GROUPS,
    OBJECTIVE,
    OPTIM,
    RAGGED,
    SMALL_MOE,
    SMALL_QWEN3,
    VOCAB,
    cpu_backend,
    make_batch,
    one_step,
    ragged_batch,
    spawn,
)
from support.scripted_turns import two_candidate_turn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rlfleet.trainer.backends.attention import VARLEN_SDPA, use_varlen_attention
from rlfleet.trainer.backends.backend_common import combine_metrics, to_token_batch
from rlfleet.trainer.backends.backend_hf import HFBackend
from rlfleet.trainer.objective import LossOutput, policy_loss
from rlfleet.trainer.rollout.batching import FlatBatch, plan_micro_batches

# Steps of 2 ranks against 1 process: the gradients differ in the last bits (the reduce-scatter sums
# in another order, each rank packs its own sequences), and Adam's g / (sqrt(v) + eps) magnifies that on an element whose gradient is near 0:
# one of 2,048 elements of a layer's gate_proj ends 2.0e-6 off on an AMD EPYC with AVX-512 (under 1e-6 on
# other CPUs). 1e-5 is 1e-3 of one step's largest update (lr); a wrong shard or a missed step is >= lr off.
TWO_STEP_WEIGHTS_ATOL = 1e-5


def tiny_llama(path: Path) -> Path:
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**SMALL_QWEN3)).save_pretrained(path)
    return path


def _gloo_avg_sums_like_torch_2_6() -> list[str]:
    """Make this process's reduce-scatters SUM where `ReduceOp.AVG` is asked for, as torch 2.6's gloo does
    (pytorch/pytorch#162338; FSDP2 asks for AVG in fp32: torch 2.6 calls `reduce_scatter_tensor`, newer
    torch `reduce_scatter_single`). Returns the list the changed calls are appended to."""
    import torch.distributed as dist

    changed: list[str] = []
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def summing(*args, _original=original, _name=name, op=dist.ReduceOp.SUM, **kwargs):
            if op == dist.ReduceOp.AVG:
                changed.append(_name)
                op = dist.ReduceOp.SUM
            return _original(*args, op=op, **kwargs)

        setattr(dist, name, summing)
    return changed


def _one_step_job(rank: int, ckpt: str, avg_sums: bool = False) -> dict:
    changed = _gloo_avg_sums_like_torch_2_6() if avg_sums else []
    backend = cpu_backend(ckpt)
    assert backend.distributed and backend.world == 2
    result = one_step(backend, make_batch())
    sd = backend.state_dict()  # a collective: every rank calls it
    result["state_keys"] = sorted(sd["model"])
    result["grads_averaged"] = backend.grads_averaged
    result["avg_made_sum"] = len(changed)
    return result


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~20 s on 2 shared cores: two spawned processes import torch + transformers
@pytest.mark.parametrize("avg_sums", [False, True], ids=["gloo", "gloo-avg-sums-like-torch-2.6"])
def test_fsdp2_two_gloo_processes_match_one_process(
    tmp_path: Path, tiny_qwen3_factory, avg_sums: bool
) -> None:
    """Full fine-tuning (every parameter trained, embedding and lm_head included). With `avg_sums` gloo's
    reduce-scatter sums where FSDP2 asks for the average (torch 2.6's, the trainer image's torch): the
    backend measures that at startup and scales the gradients by 1 instead of the world size; without
    that every 2-rank gradient was 2x the one-process one (max |diff| 0.31 on torch 2.6)."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    single = one_step(cpu_backend(ckpt), make_batch())
    multi = spawn(tmp_path, _one_step_job, str(ckpt), avg_sums)[0]

    if avg_sums:  # the emulation really changed FSDP2's gradient reduce-scatters, and the backend saw it
        assert multi["avg_made_sum"] > 0
        assert multi["grads_averaged"] is False
    assert abs(multi["loss"] - single["loss"]) < 1e-6
    assert multi["grads"].keys() == single["grads"].keys()
    for name, g in single["grads"].items():
        assert float(g.abs().max()) > 0, name  # every parameter is really trained
        torch.testing.assert_close(multi["grads"][name], g, rtol=0, atol=1e-6, msg=name)
    for name, w in single[
        "weights"
    ].items():  # Adam magnifies last-bit gradient differences (TWO_STEP_WEIGHTS_ATOL)
        torch.testing.assert_close(multi["weights"][name], w, rtol=0, atol=TWO_STEP_WEIGHTS_ATOL, msg=name)
    assert abs(multi["grad_norm"] - single["grad_norm"]) < 1e-5
    # Metrics combined over ranks equal the one-process metrics (ess is one-process only).
    for key, value in single["metrics"].items():
        if key != "ess":
            assert abs(multi["metrics"][key] - value) < 1e-5, key
    for gid, gm in single["per_group"].items():
        assert multi["per_group"][gid]["num_tokens"] == gm["num_tokens"]
        assert abs(multi["per_group"][gid]["kl_k3"] - gm["kl_k3"]) < 1e-5
    assert "model.layers.0.self_attn.q_proj.weight" in multi["state_keys"]


# --- checkpoint and restore ---------------------------------------------------------------------

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def trainer_state(backend: HFBackend) -> dict:
    """What restore must bring back, read from the live model and optimizer (NOT through
    `state_dict()`): this rank's own shards of the weights and Adam moments, and the full tensors."""
    full: dict[str, dict[str, torch.Tensor]] = {}
    local: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in backend.model.named_parameters():
        moments = backend.optimizer.state[p]
        full[name] = {"param": _full(p), **{k: _full(moments[k]) for k in ADAM_KEYS}}
        local[name] = {"param": _local(p), **{k: _local(moments[k]) for k in ADAM_KEYS}}
    return {"full": full, "local": local}


def _resume_job(rank: int, ckpts: list[str], out_dir: str) -> dict:
    """Per checkpoint: train step 1, `state_dict()`, and rank 0 writes it to a file (the training loop
    runs on rank 0: trainer/loop.py `checkpoint()` -> trainer/publish/checkpoint.py `torch.save`; read back
    weights-only, as `load_latest` does). Then step 2
    three ways on this rank: uninterrupted; a FRESH backend built from the same base checkpoint that
    `load_state_dict`s what rank 0 read back from the file while the other ranks pass what their own
    `state_dict()` returned; and a fresh one where every rank reads the file (a shared volume). One
    process (rank 0, no process group) runs the same job."""
    from rlfleet.trainer.publish.checkpoint import load_checkpoint_file

    distributed = torch.distributed.is_initialized()
    first, second = make_batch(seed=1), make_batch(seed=2)
    out: dict = {}
    for i, ckpt in enumerate(ckpts):
        path = Path(out_dir) / f"trainer-ckpt-{i}.pt"
        uninterrupted = cpu_backend(ckpt)
        uninterrupted.train_step(first, GROUPS)
        own_state = uninterrupted.state_dict()  # a collective: every rank calls it
        if rank == 0:
            torch.save(own_state, path)
        if distributed:
            torch.distributed.barrier()
        runs: dict = {"after_step_1": trainer_state(uninterrupted)}
        # read back as a resume reads a checkpoint: weights only (trainer/publish/checkpoint.py, no allowlist entry)
        restores = {
            "rank0_reads": load_checkpoint_file(path) if rank == 0 else own_state,
            "every_rank_reads": load_checkpoint_file(path),
        }
        backends = {"uninterrupted": uninterrupted}
        for how, state in restores.items():
            backends[how] = cpu_backend(ckpt)
            backends[how].load_state_dict(state)
            runs[f"{how}_loaded"] = trainer_state(backends[how])
        for how, backend in backends.items():
            loss, _ = backend.train_step(second, GROUPS)
            runs[how] = {
                "loss": float(loss.loss.detach()),
                "weights": backend.weights(),
                **trainer_state(backend),
            }
        out[ckpt] = runs
    return out


def assert_same_state(got: dict, want: dict, where: str, atol: float = 0.0) -> None:
    """Weights and Adam moments (full tensors and this rank's shards) equal, to `atol` (0: bitwise)."""
    for scope in ("full", "local"):
        assert got[scope].keys() == want[scope].keys(), where
        for name, tensors in want[scope].items():
            for key, t in tensors.items():
                torch.testing.assert_close(
                    got[scope][name][key], t, rtol=0, atol=atol, msg=f"{where}: {scope} {name} {key}"
                )


def assert_resumed_equals_uninterrupted(runs: dict, where: str, atol: float = 0.0) -> None:
    step1 = runs["after_step_1"]
    assert all(float(m["step"]) == 1.0 for m in step1["full"].values()), where
    assert all(float(m["exp_avg_sq"].abs().max()) > 0 for m in step1["full"].values()), where
    want = runs["uninterrupted"]
    assert all(float(m["step"]) == 2.0 for m in want["full"].values()), where
    for how in ("rank0_reads", "every_rank_reads"):
        # Right after load_state_dict: this rank's shards are the step-1 ones, not the initial weights.
        assert_same_state(runs[f"{how}_loaded"], step1, f"{where} {how} after load", atol)
        got = runs[how]
        assert abs(got["loss"] - want["loss"]) <= atol, (where, how, got["loss"], want["loss"])
        assert got["weights"].keys() == want["weights"].keys()
        for name, w in want["weights"].items():
            torch.testing.assert_close(
                got["weights"][name], w, rtol=0, atol=atol, msg=f"{where} {how} {name}"
            )
        assert_same_state(got, want, f"{where} {how} after step 2", atol)


@pytest.mark.parametrize("tie", [False, True])
def test_one_process_restore_equals_the_uninterrupted_run(
    tmp_path: Path, tiny_qwen3_factory, tie: bool
) -> None:
    """One process: the resumed step 2 is bit-identical to the uninterrupted one (same weights, same
    Adam moments and step, same deterministic CPU kernels)."""
    ckpt = str(tiny_qwen3_factory(**SMALL_QWEN3, tie_word_embeddings=tie))
    runs = _resume_job(0, [ckpt], str(tmp_path))[ckpt]
    assert_resumed_equals_uninterrupted(runs, "1 process")


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~12 s on 2 shared cores: two spawned processes import torch + transformers
def test_fsdp2_restore_on_two_gloo_processes_equals_the_uninterrupted_run(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    """Two processes, untied and tied embeddings: a checkpoint saved by rank 0 restores EVERY rank's
    shards of the weights and Adam moments, and the resumed step 2 equals the uninterrupted one on
    every rank, bitwise (same shards, same gloo reduction order). The uninterrupted 2-process run
    also equals one process's: losses to 1e-6, weights to TWO_STEP_WEIGHTS_ATOL (fp32 sums over 2 shards
    vs 1: the reduce-scatter's order)."""
    ckpts = [str(tiny_qwen3_factory(**SMALL_QWEN3, tie_word_embeddings=tie)) for tie in (False, True)]
    per_rank = spawn(tmp_path / "multi", _resume_job, ckpts, str(tmp_path / "multi"))
    single = _resume_job(0, ckpts, str(tmp_path))
    for ckpt in ckpts:
        for rank, result in enumerate(per_rank):
            assert_resumed_equals_uninterrupted(result[ckpt], f"rank {rank} of 2")
        multi, one = per_rank[0][ckpt]["uninterrupted"], single[ckpt]["uninterrupted"]
        assert abs(multi["loss"] - one["loss"]) < 1e-6
        for name, w in one["weights"].items():
            torch.testing.assert_close(
                multi["weights"][name], w, rtol=0, atol=TWO_STEP_WEIGHTS_ATOL, msg=name
            )
    # The ranks hold different shards (a sharded run, not two replicas).
    name = "model.layers.0.mlp.up_proj.weight"
    ckpt = ckpts[0]
    shards = [r[ckpt]["uninterrupted"]["local"][name]["param"] for r in per_rank]
    assert (
        shards[0].shape[0] + shards[1].shape[0]
        == per_rank[0][ckpt]["uninterrupted"]["weights"][name].shape[0]
    )
    assert not torch.equal(shards[0], shards[1])


def _drive_or_follow_job(rank: int, ckpt: str) -> dict:
    """What the trainer entrypoint does (trainer/entrypoint.py): rank 0 drives, every other rank only
    calls `follow()`. Rank 0: step 1, `state_dict()` (serialised, as trainer/publish/checkpoint.py saves it),
    step 2, `weights()`, `load_state_dict(step-1 state)`, step 2 again, `weights()`, `close()`: every
    command kind. Rank 1 returns its own shards once `follow()` has returned."""
    import io

    backend = cpu_backend(ckpt)
    assert backend.distributed and backend.world == 2
    if rank != 0:
        backend.follow()
        return {
            "follow_returned": True,
            "shards": {n: _local(p) for n, p in backend.model.named_parameters()},
        }
    first, second = make_batch(seed=1), make_batch(seed=2)
    losses = [float(backend.train_step(first, GROUPS)[0].loss.detach())]
    buffer = io.BytesIO()
    torch.save(backend.state_dict(), buffer)
    losses.append(float(backend.train_step(second, GROUPS)[0].loss.detach()))
    weights = backend.weights()
    buffer.seek(0)
    backend.load_state_dict(torch.load(buffer, weights_only=False))
    replayed_loss = float(backend.train_step(second, GROUPS)[0].loss.detach())
    replayed_weights = backend.weights()
    backend.close()
    return {
        "losses": losses,
        "weights": weights,
        "replayed_loss": replayed_loss,
        "replayed_weights": replayed_weights,
    }


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~12 s on 2 shared cores: two spawned processes import torch + transformers
def test_rank_0_drives_and_rank_1_follows_like_one_process(tmp_path: Path, tiny_qwen3_factory) -> None:
    """Two gloo processes, rank 1 never calls the public methods: rank 0's losses equal one process's
    to 1e-6 and its weights to TWO_STEP_WEIGHTS_ATOL (fp32; the 2-rank run sums the gradient in another
    order, over its two shards' reduce-scatter, so it is not bitwise), the restored step 2 replays the first bitwise, rank 1's own
    shards are the slices of rank 0's full weights (it really trained and restored), and its `follow()`
    returned after `close()` (the job saves its result only then; a follower stuck in the broadcast
    would time out and fail the spawn)."""
    ckpt = str(tiny_qwen3_factory(**SMALL_QWEN3))
    single = cpu_backend(ckpt)
    want_losses = [float(single.train_step(make_batch(seed=s), GROUPS)[0].loss.detach()) for s in (1, 2)]
    want = single.weights()
    driver, follower = spawn(tmp_path, _drive_or_follow_job, ckpt)

    assert want_losses[0] != want_losses[1]
    for got, expected in zip(driver["losses"], want_losses, strict=True):
        assert abs(got - expected) < 1e-6
    assert driver["weights"].keys() == want.keys()
    initial = cpu_backend(ckpt).weights()
    for name, w in want.items():
        assert not torch.equal(w, initial[name]), name  # two steps moved every weight
        torch.testing.assert_close(driver["weights"][name], w, rtol=0, atol=TWO_STEP_WEIGHTS_ATOL, msg=name)
    assert driver["replayed_loss"] == driver["losses"][1]
    for name, w in driver["weights"].items():
        assert torch.equal(driver["replayed_weights"][name], w), name
    assert follower["follow_returned"]
    assert follower["shards"].keys() == want.keys()
    for name, shard in follower["shards"].items():  # FSDP2 shards dim 0: rank 1 holds the second chunk
        assert torch.equal(shard, driver["replayed_weights"][name].chunk(2, dim=0)[1]), name


TORCHRUN_WORKER = """
import json, os, sys
import torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
import torch.distributed as dist
from rlfleet.trainer.entrypoint import exit_now
from support.hf_backend_steps import GROUPS, cpu_backend, make_batch
assert not dist.is_initialized()
backend = cpu_backend({ckpt!r})  # joins torchrun's group
result = {{"rank": backend.rank, "world": backend.world, "backend": dist.get_backend()}}
if backend.rank != 0:
    backend.follow()
else:
    result["loss"] = float(backend.train_step(make_batch(seed=1), GROUPS)[0].loss.detach())
    result["weights"] = len(backend.weights())
    backend.close()
with open(os.path.join({out!r}, "rank%d.json" % backend.rank), "w") as fh:
    json.dump(result, fh)
exit_now(0)  # and ends as it does, without the interpreter's shutdown
"""


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~7 s: torchrun starts two processes that import torch + transformers
def test_under_torchrun_the_backend_joins_the_process_group_and_rank_1_follows(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    """The trainer pod's launch (operator/builders.py: torchrun, one rank per GPU; here 2 CPU ranks):
    the backend initialises the process group torchrun describes (gloo without GPUs), rank 0 drives a
    step and a publish, rank 1 follows until `close()`. `--standalone` picks its own free port."""
    import json
    import subprocess
    import sys

    ckpt = str(tiny_qwen3_factory(**SMALL_QWEN3))
    script = tmp_path / "worker.py"
    script.write_text(
        TORCHRUN_WORKER.format(tests=str(Path(__file__).parents[1]), ckpt=ckpt, out=str(tmp_path))
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["world"], r["backend"]) for r in ranks] == [(0, 2, "gloo"), (1, 2, "gloo")]
    single = cpu_backend(ckpt)
    want = float(single.train_step(make_batch(seed=1), GROUPS)[0].loss.detach())
    assert abs(ranks[0]["loss"] - want) < 1e-6
    assert ranks[0]["weights"] == len(single.weights())


def _reference_loss(model: torch.nn.Module, flat: FlatBatch) -> float:
    """The objective on the FULL logits of the model (no logits_to_keep), rows gathered by hand."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(flat.input_ids)).logits
    rows = logits[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)] / 0.7
    # the materialised rows through the fused objective: hidden = the logit rows, weight = identity
    return float(policy_loss(rows, torch.eye(VOCAB), to_token_batch(flat, GROUPS), OBJECTIVE).loss)


def test_one_process_loss_is_the_objective_on_the_model_logits_qwen3_and_llama(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    from transformers import AutoModelForCausalLM

    for ckpt in (tiny_qwen3_factory(**SMALL_QWEN3), tiny_llama(tmp_path / "l")):
        flat = make_batch(num_seqs=3, seed=4)
        expected = _reference_loss(AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32), flat)
        backend = cpu_backend(ckpt, temperature=0.7)
        assert not backend.distributed
        out, grad_norm = backend.train_step(flat, GROUPS)
        assert abs(float(out.loss.detach()) - expected) < 1e-6
        assert np.isfinite(grad_norm) and grad_norm > 0
        assert out.metrics["num_tokens"] == flat.num_tokens
        assert set(out.per_group) == {0, 1}


@pytest.mark.parametrize("tie", [False, True])
def test_weights_carry_exactly_the_hf_checkpoint_names(tiny_qwen3_factory, tie: bool) -> None:
    """`weights()` holds exactly the checkpoint's names: a tied lm_head (Qwen3-0.6B) is stored once."""
    from safetensors import safe_open

    ckpt = tiny_qwen3_factory(**SMALL_QWEN3, tie_word_embeddings=tie)
    backend = cpu_backend(ckpt)
    backend.train_step(make_batch(seed=1), GROUPS)
    weights = backend.weights()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(weights)
    assert ("lm_head.weight" in weights) is not tie
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_combine_metrics_token_weighted() -> None:
    parts = [
        {"num_tokens": 3.0, "invalid_tokens": 1.0, "kl_k3": 0.1, "sc_tail_ratio_max": 2.0, "ess": 0.9},
        {"num_tokens": 1.0, "invalid_tokens": 0.0, "kl_k3": 0.5, "sc_tail_ratio_max": 3.0, "ess": 0.5},
    ]
    out = combine_metrics(parts)
    assert out == {
        "num_tokens": 4.0,
        "invalid_tokens": 1.0,
        "kl_k3": (0.3 + 0.5) / 4,
        "sc_tail_ratio_max": 3.0,
    }


def test_batch_smaller_than_world_is_a_clear_error(tiny_qwen3_factory) -> None:
    backend = cpu_backend(tiny_qwen3_factory(**SMALL_QWEN3))
    backend.world = 4  # the split rule alone (no process group needed)
    try:
        backend.local_sequences(make_batch(num_seqs=3))
    except ValueError as exc:
        assert "3 sequences cannot be split over 4" in str(exc)
    else:
        raise AssertionError("no error")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu_tracks_the_fp32_cpu_loss(tiny_qwen3_factory) -> None:
    """On a GPU the forward runs in bf16 (fp32 master weights): the loss is the fp32 one to bf16 accuracy."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    flat = make_batch(seed=5)
    cpu, _ = cpu_backend(ckpt).train_step(flat, GROUPS)
    gpu_backend = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cuda")
    assert gpu_backend.bf16 and next(gpu_backend.model.parameters()).dtype == torch.float32
    gpu, grad_norm = gpu_backend.train_step(flat, GROUPS)
    assert abs(float(gpu.loss.detach()) - float(cpu.loss.detach())) < 2e-2 and np.isfinite(grad_norm)


def test_chat_prompts_math_env_and_hf_backend_compose(tmp_path: Path) -> None:
    """The pieces a real-model run composes: a text prompt set rendered with the chat template, the
    math environment, the real rollout driver and batching, and one step of the hf backend on a Qwen3
    whose vocabulary is the tokenizer's. The trained target ids are exactly the sampled ids. The
    sampler is a stub (no engine runs here) that replies from a fixed list with a 2-token support."""
    import asyncio
    import json

    from chat_tokenizer import build_chat_tokenizer

    from rlfleet.records import SampledTurn
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.trainer.envs.environments import load_environment
    from rlfleet.trainer.envs.prompts import open_prompt_source
    from rlfleet.trainer.rollout.batching import flatten_groups
    from rlfleet.trainer.rollout.driver import PromptGroup, RolloutDriver

    tok = build_chat_tokenizer()
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    prompts = open_prompt_source(str(tmp_path / "p.jsonl"), "math", tokenizer=tok, vocab_size=len(tok))
    env = load_environment("rlfleet.trainer.envs.environments:MathEnv", tokenizer=tok)
    replies = [tok.encode(t) + [tok.eos_token_id] for t in ("The answer is \\boxed{5}.", "It is 7")]

    async def generate(session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        return two_candidate_turn(ids, replies[int(session.split("/")[1])], len(tok), "h100-fp8")

    driver = RolloutDriver(
        generate,
        env,
        prompts,
        samples_per_prompt=2,
        sampling=SamplingConfig(max_new_tokens=32),
        max_seq_len=128,
    )
    prompt = prompts.get(0)
    rollouts = [asyncio.run(driver.run_episode(prompt, k)) for k in range(2)]
    assert [r.outcome.reward for r in rollouts] == [1.0, 0.0]
    flat = flatten_groups([PromptGroup(prompt=prompt, rollouts=rollouts)], trainer_version=0)
    assert flat.target_ids.tolist() == replies[0] + replies[1]

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    backend = cpu_backend(tmp_path / "m")
    out, grad_norm = backend.train_step(flat, {"h100-fp8": 0})
    assert out.metrics["num_tokens"] == len(replies[0]) + len(replies[1]) and grad_norm > 0


# --- token-budget micro-batches ------------------------------------------------------------------


def test_micro_batch_plan_covers_every_sequence_within_the_budget() -> None:
    flat = ragged_batch()
    need = [n - 1 for n in RAGGED]  # through the last sampled token's logit position (its own position - 1)
    plan = plan_micro_batches(flat, np.arange(len(RAGGED)), 32)
    assert sorted(b for mb in plan for b in mb.seqs.tolist()) == list(range(len(RAGGED)))
    assert sorted(r for mb in plan for r in mb.rows.tolist()) == list(range(flat.num_tokens))
    for mb in plan:
        assert mb.lengths.tolist() == [need[b] for b in mb.seqs]
        assert mb.num_tokens <= 32 or len(mb.seqs) == 1, mb
    # first-fit decreasing: 29 | 23 + 8 | 16 + 11 + 5 | 4 (the packed plan)
    packed = plan_micro_batches(flat, np.arange(len(RAGGED)), 32)
    assert [mb.lengths.tolist() for mb in packed] == [[29], [23, 8], [16, 11, 5], [4]]
    # one sequence over the budget trains alone; a budget below 1 is refused
    assert [mb.lengths.tolist() for mb in plan_micro_batches(flat, np.array([0]), 10)] == [[29]]
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_micro_batches(flat, np.arange(3), 0)


@pytest.mark.parametrize("attn", ["sdpa", "eager", VARLEN_SDPA])
def test_packed_forward_equals_each_sequence_alone(tiny_qwen3_factory, attn: str) -> None:
    """Position ids that restart at each sequence keep attention within each: transformers' block-causal
    mask (sdpa, eager) and the backend's per-sequence attention (trainer/backends/attention.py). Every packed logit
    equals that sequence's own forward with transformers' sdpa (and without use_cache=False they would
    not: the guard)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_qwen3_factory(**SMALL_QWEN3)), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    alone_model = copy.deepcopy(model)
    if attn == VARLEN_SDPA:
        assert use_varlen_attention(model)
    else:
        model.set_attn_implementation(attn)
    assert model.config._attn_implementation == attn
    flat = ragged_batch()
    mb = plan_micro_batches(flat, np.arange(len(RAGGED)), 64)[0]
    assert len(mb.seqs) >= 3
    input_ids, position_ids, _ = mb.packed(flat)
    with torch.no_grad():
        # use_cache=False, as the backend passes it: with a cache transformers ignores the restarts
        packed = model(
            input_ids=torch.from_numpy(input_ids)[None],
            position_ids=torch.from_numpy(position_ids)[None],
            use_cache=False,
        ).logits[0]
        start = 0
        for b, n in zip(mb.seqs.tolist(), mb.lengths.tolist(), strict=True):
            alone = alone_model(input_ids=torch.from_numpy(flat.input_ids[b, :n])[None]).logits[0]
            torch.testing.assert_close(packed[start : start + n], alone, rtol=0, atol=1e-5)
            start += n
        leaky = model(
            input_ids=torch.from_numpy(input_ids)[None], position_ids=torch.from_numpy(position_ids)[None]
        ).logits[0]
    if attn == VARLEN_SDPA:  # it reads the restarts from the position ids, cache or not
        torch.testing.assert_close(leaky, packed, rtol=0, atol=1e-6)
    else:  # with a cache transformers builds a plain causal mask: sequences see each other
        assert float((leaky - packed).abs().max()) > 1e-2


def stepped(model: torch.nn.Module, out: LossOutput) -> dict:
    """A reference step after its backward: the objective's loss, metrics and per-group metrics, and
    every parameter's gradient."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {
        "loss": float(out.loss.detach()),
        "metrics": out.metrics,
        "per_group": out.per_group,
        "grads": grads,
    }


def reference_step(ckpt: Path, flat: FlatBatch) -> dict:
    """The unbatched step by hand: one padded forward of the whole batch, the objective on the rows'
    final hidden states and lm_head, backward of the token-mean loss (no backend code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    hidden = model.model(input_ids=torch.from_numpy(flat.input_ids), use_cache=False).last_hidden_state
    rows = hidden[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]
    out = policy_loss(rows, model.lm_head.weight, to_token_batch(flat, GROUPS), OBJECTIVE)
    out.loss.backward()
    return stepped(model, out)


def assert_step_equals_reference(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert abs(got["loss"] - want["loss"]) < atol
    for name, g in want["grads"].items():
        assert float(g.abs().max()) > 0, name
        torch.testing.assert_close(got["grads"][name], g, rtol=0, atol=atol, msg=name)
    for key, value in want["metrics"].items():
        if key != "ess":  # not decomposable over micro-batches
            assert abs(got["metrics"][key] - value) < 1e-5, key
    for gid, gm in want["per_group"].items():
        assert got["per_group"][gid]["num_tokens"] == gm["num_tokens"]
        assert abs(got["per_group"][gid]["entropy"] - gm["entropy"]) < 1e-5


@pytest.mark.parametrize("budget", [24, 40, 1 << 14])
def test_micro_batched_step_equals_the_unbatched_step(tiny_qwen3_factory, budget: int) -> None:
    """A ragged batch cut into packed micro-batches of at most `budget` tokens: the accumulated
    gradient, the loss and the metrics equal one padded forward of the whole batch."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    flat = ragged_batch()
    want = reference_step(ckpt, flat)
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=budget)
    plan = plan_micro_batches(flat, np.arange(len(RAGGED)), budget)
    assert (len(plan) > 2) is (budget < 64)
    got = one_step(backend, flat)
    assert_step_equals_reference(got, want)
    assert ("ess" in got["metrics"]) is (len(plan) == 1)


def test_activation_checkpointing_gives_the_same_step(tiny_qwen3_factory) -> None:
    """Gradient checkpointing (each decoder layer recomputed in backward) with packed micro-batches:
    the same gradients as the unbatched reference, and the layers really are checkpointed."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    flat = ragged_batch()
    want = reference_step(ckpt, flat)
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=24, activation_checkpointing=True)
    assert backend.model.is_gradient_checkpointing
    assert_step_equals_reference(one_step(backend, flat), want)


def _budget_step_job(rank: int, ckpt: str, budget: int) -> dict:
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=budget)
    assert backend.distributed and backend.world == 2
    # rank 0 gets sequences 0, 2, 4, 6 (4 micro-batches at 24), rank 1 sequences 1, 3, 5 (2): rank 1 idles twice
    plans = [
        plan_micro_batches(
            ragged_batch(),
            backend.local_sequences(ragged_batch(), r),
            budget,
        )
        for r in (0, 1)
    ]
    result = one_step(backend, ragged_batch())
    result["plan_sizes"] = [len(p) for p in plans]
    return result


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~15 s on 2 shared cores: two spawned processes import torch + transformers
def test_micro_batches_on_two_gloo_processes_equal_the_unbatched_step(
    tmp_path: Path, tiny_qwen3_factory
) -> None:
    """Two FSDP2 ranks with unequal numbers of micro-batches (the idle rank runs zero-loss ones): the
    reduced gradient is the one-process, one-forward gradient of the whole batch."""
    ckpt = tiny_qwen3_factory(**SMALL_QWEN3)
    want = reference_step(ckpt, ragged_batch())
    ranks = spawn(tmp_path, _budget_step_job, str(ckpt), 24)
    assert ranks[0]["plan_sizes"][0] != ranks[0]["plan_sizes"][1]
    for got in ranks:
        assert_step_equals_reference(got, want)


# ------------------------------------------------------------------------------------ mixture of experts
def switch_load_balancing_loss(router_logits: list[torch.Tensor], experts: int, top_k: int) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss over the tokens of `router_logits` (one [tokens,
    experts] per layer), written out: experts x sum_e f_e P_e, f_e the share of the (token, layer)
    top-k slots routed to e (counted per token, so a token adds top_k), P_e the mean router probability
    of e over (token, layer)."""
    probs = torch.cat([torch.softmax(g, dim=-1) for g in router_logits])  # [layers x tokens, E]
    chosen = torch.zeros_like(probs).scatter_(1, probs.topk(top_k, dim=-1).indices, 1.0)
    return experts * (chosen.mean(dim=0) * probs.mean(dim=0)).sum()


def moe_reference_step(ckpt: Path, flat: FlatBatch, budget: int) -> dict:
    """The MoE step by hand: one padded forward of the whole batch (no backend code), the objective on
    the rows' final hidden states and lm_head, plus router_aux_loss_coef x the token-weighted mean over
    the micro-batches (the plan for `budget`) of each one's load-balancing loss over exactly the tokens it
    packs (each sequence up to its last trained row), weighted by its trained rows."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    out = model.model(input_ids=torch.from_numpy(flat.input_ids), use_cache=False, output_router_logits=True)
    rows = out.last_hidden_state[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]
    objective = policy_loss(rows, model.lm_head.weight, to_token_batch(flat, GROUPS), OBJECTIVE)
    assert objective.num_valid_tokens == len(flat.row_seq)  # every row of make_batch is valid
    layers = [g.reshape(flat.input_ids.shape[0], flat.input_ids.shape[1], -1) for g in out.router_logits]
    aux = torch.zeros(())
    for mb in plan_micro_batches(flat, np.arange(flat.input_ids.shape[0]), budget):
        packed = [
            torch.cat([g[b, :n] for b, n in zip(mb.seqs.tolist(), mb.lengths.tolist(), strict=True)])
            for g in layers
        ]
        weight = int(np.isin(flat.row_seq, mb.seqs).sum()) / len(flat.row_seq)
        aux = aux + weight * switch_load_balancing_loss(
            packed, model.config.num_experts, model.config.num_experts_per_tok
        )
    (objective.loss + model.config.router_aux_loss_coef * aux).backward()
    return stepped(model, objective) | {"aux": float(aux.detach())}


@pytest.mark.parametrize("budget", [24, 1 << 14])
def test_a_moe_step_equals_the_hand_computed_step_router_loss_included(
    tiny_qwen3_factory, budget: int
) -> None:
    """Qwen3-MoE through the packed micro-batches and the fused lm_head: the loss (the policy loss), every
    gradient (experts, routers, attention, embeddings) and the metrics equal the hand-computed step,
    whose router load-balancing term is computed here from the router logits of a padded forward; the
    router's term really is in the step (without it the routers' gradients differ)."""
    ckpt = tiny_qwen3_factory(**SMALL_MOE)
    flat = ragged_batch()
    want = moe_reference_step(ckpt, flat, budget)
    assert want["aux"] > 1.0  # experts x sum f_e P_e >= 1, equality only for perfectly balanced routing
    backend = cpu_backend(ckpt, max_tokens_per_micro_batch=budget)
    assert type(backend.model).__name__ == "Qwen3MoeForCausalLM"
    got = one_step(backend, flat)
    assert any("experts.gate_up_proj" in n for n in want["grads"]) and any(
        "mlp.gate.weight" in n for n in want["grads"]
    )
    assert_step_equals_reference(got, want, atol=2e-6)
    without_aux = HFBackend(
        tiny_qwen3_moe_without_router_loss(ckpt),
        OBJECTIVE,
        optim=OPTIM,
        device="cpu",
        max_tokens_per_micro_batch=budget,
    )
    router = "model.layers.0.mlp.gate.weight"
    assert float((one_step(without_aux, flat)["grads"][router] - want["grads"][router]).abs().max()) > 1e-4


def tiny_qwen3_moe_without_router_loss(ckpt: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, output_router_logits=False)


def test_moe_one_process_restore_equals_the_uninterrupted_run(tmp_path: Path, tiny_qwen3_factory) -> None:
    """Qwen3-MoE: step 1, save, restore into a fresh backend, step 2: bit-identical to the uninterrupted
    step 2 (weights, Adam moments of every expert and router)."""
    ckpt = str(tiny_qwen3_factory(**SMALL_MOE))
    runs = _resume_job(0, [ckpt], str(tmp_path))[ckpt]
    assert any("experts.down_proj" in name for name in runs["uninterrupted"]["full"])
    assert_resumed_equals_uninterrupted(runs, "1 process, MoE")
