"""The `hf` backend (trainer/backend_hf.py) on real transformers models (tiny Qwen3 and Llama built
from their configs and saved as real HF checkpoints), fp32 on CPU.

- one process: the loss equals the objective on the model's full logits (the `logits_to_keep` row
  gather is exact), for Qwen3 and Llama;
- FSDP2 (`fully_shard`) over 2 gloo processes on CPU: the same loss, the same gradients after the
  reduce-scatter and the same updated weights as one process, to 1e-6;
- checkpoints round-trip and `weights()` carries the HF parameter names.
No stubs: real models, real torch.distributed (gloo, a file:// rendezvous).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rlfleet.records import SUPPORT_MODE
from rlfleet.trainer.backend_common import OptimConfig, to_token_batch
from rlfleet.trainer.backend_hf import HFBackend, combine_metrics
from rlfleet.trainer.batching import FlatBatch
from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

VOCAB = 96
OBJECTIVE = ObjectiveConfig(mode="sc_mis", replay=True)
OPTIM = OptimConfig(learning_rate=1e-2, max_grad_norm=1e9)  # no clipping: raw gradients are compared


def tiny_qwen3(path: Path, tie: bool = False) -> Path:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


def tiny_llama(path: Path) -> Path:
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_batch(num_seqs: int = 5, seed: int = 0) -> FlatBatch:
    """Sequences of different lengths (right-padded), a 4-token prompt, sampled tokens after it, each
    with a support of 4 candidates (the sampled one included, q renormalised on it)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(7, 13, size=num_seqs)
    input_ids = np.zeros((num_seqs, int(lens.max())), dtype=np.int64)
    cols: dict[str, list] = {
        k: [] for k in ("seq", "pos", "tgt", "adv", "lq", "ids", "clq", "cnt", "grp", "st")
    }
    for b, n in enumerate(lens):
        input_ids[b, :n] = rng.integers(1, VOCAB, size=n)
        adv = float(rng.normal())
        for s in range(4, int(n)):
            tgt = int(input_ids[b, s])
            others = rng.choice(np.setdiff1d(np.arange(VOCAB), [tgt]), size=3, replace=False)
            ids = np.concatenate([[tgt], others])
            lq = np.log(rng.dirichlet(np.ones(4))).astype(np.float32)
            cols["seq"].append(b)
            cols["pos"].append(s - 1)
            cols["tgt"].append(tgt)
            cols["adv"].append(adv)
            cols["lq"].append(lq[0])
            cols["ids"].append(ids)
            cols["clq"].append(lq)
            cols["cnt"].append(4)
            cols["grp"].append("h100-fp8" if b % 2 else "b200-nvfp4")
            cols["st"].append(int(b % 3))
    t = len(cols["tgt"])
    offsets = np.zeros(t + 1, dtype=np.int64)
    np.cumsum(cols["cnt"], out=offsets[1:])
    lq = np.array(cols["lq"], dtype=np.float32)
    return FlatBatch(
        input_ids=input_ids, seq_lens=lens.astype(np.int64),
        row_seq=np.array(cols["seq"], dtype=np.int64), row_pos=np.array(cols["pos"], dtype=np.int64),
        target_ids=np.array(cols["tgt"], dtype=np.int64), advantages=np.array(cols["adv"], dtype=np.float32),
        logq=lq - 0.1, logq_support=lq,
        cand_offsets=offsets, cand_ids=np.concatenate(cols["ids"]).astype(np.int64),
        cand_logq=np.concatenate(cols["clq"]).astype(np.float32), candidate_mode=SUPPORT_MODE,
        versions=np.zeros(t, dtype=np.int64), staleness=np.array(cols["st"], dtype=np.int64),
        groups=np.array(cols["grp"], dtype=object),
    )  # fmt: skip


GROUPS = {"b200-nvfp4": 0, "h100-fp8": 1}


def one_step(backend: HFBackend, flat: FlatBatch) -> dict:
    out, grad_norm = backend.train_step(flat, GROUPS)
    grads = {}
    for name, p in backend.model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {"loss": float(out.loss.detach()), "metrics": out.metrics, "per_group": out.per_group,
            "grads": grads, "weights": backend.weights(), "grad_norm": grad_norm}  # fmt: skip


def _worker(rank: int, world: int, init_file: str, ckpt: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A file:// rendezvous in the test's own tmp dir: concurrent runs cannot meet each other (a free
    # TCP port can be taken by another run between probing and binding); a timeout turns a stuck
    # collective into an error instead of a hang.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    try:
        backend = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu")
        assert backend.distributed and backend.world == world
        result = one_step(backend, make_batch())
        sd = backend.state_dict()  # a collective: every rank calls it
        result["state_keys"] = sorted(sd["model"])
        if rank == 0:
            torch.save(result, Path(out_dir) / "result.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.slow  # ~20 s on 2 shared cores: two spawned processes import torch + transformers
def test_fsdp2_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    ckpt = tiny_qwen3(tmp_path / "qwen3")
    single = one_step(HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu"), make_batch())
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(ckpt), str(tmp_path)), nprocs=2, join=True)
    multi = torch.load(tmp_path / "result.pt", weights_only=False)

    assert abs(multi["loss"] - single["loss"]) < 1e-6
    assert multi["grads"].keys() == single["grads"].keys()
    for name, g in single["grads"].items():
        assert float(g.abs().max()) > 0, name  # every parameter is really trained
        torch.testing.assert_close(multi["grads"][name], g, rtol=0, atol=1e-6, msg=name)
    for name, w in single["weights"].items():
        torch.testing.assert_close(multi["weights"][name], w, rtol=0, atol=1e-6, msg=name)
    assert abs(multi["grad_norm"] - single["grad_norm"]) < 1e-5
    # Metrics combined over ranks equal the one-process metrics (ess is one-process only).
    for key, value in single["metrics"].items():
        if key != "ess":
            assert abs(multi["metrics"][key] - value) < 1e-5, key
    for gid, gm in single["per_group"].items():
        assert multi["per_group"][gid]["num_tokens"] == gm["num_tokens"]
        assert abs(multi["per_group"][gid]["kl_k3"] - gm["kl_k3"]) < 1e-5
    assert "model.layers.0.self_attn.q_proj.weight" in multi["state_keys"]


def _reference_loss(model: torch.nn.Module, flat: FlatBatch) -> float:
    """The objective on the FULL logits of the model (no logits_to_keep), rows gathered by hand."""
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(flat.input_ids)).logits
    rows = logits[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)] / 0.7
    return float(policy_loss(rows, to_token_batch(flat, GROUPS), OBJECTIVE).loss)


def test_one_process_loss_is_the_objective_on_the_model_logits_qwen3_and_llama(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    for ckpt in (tiny_qwen3(tmp_path / "q"), tiny_llama(tmp_path / "l")):
        flat = make_batch(num_seqs=3, seed=4)
        expected = _reference_loss(AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32), flat)
        backend = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, temperature=0.7, device="cpu")
        assert not backend.distributed
        out, grad_norm = backend.train_step(flat, GROUPS)
        assert abs(float(out.loss.detach()) - expected) < 1e-6
        assert np.isfinite(grad_norm) and grad_norm > 0
        assert out.metrics["num_tokens"] == flat.num_tokens
        assert set(out.per_group) == {0, 1}


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip_and_hf_weight_names(tmp_path: Path, tie: bool) -> None:
    """`weights()` holds exactly the checkpoint's names: a tied lm_head (Qwen3-0.6B) is stored once."""
    ckpt = tiny_qwen3(tmp_path / "q", tie=tie)
    a = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu")
    a.train_step(make_batch(seed=1), GROUPS)
    path = tmp_path / "ckpt.pt"
    torch.save(a.state_dict(), path)  # what trainer/checkpoint.py does: the state leaves the process
    state = torch.load(path, weights_only=False)
    b = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu")
    b.load_state_dict(state)
    flat = make_batch(seed=2)
    out_a, _ = a.train_step(flat, GROUPS)
    out_b, _ = b.train_step(flat, GROUPS)
    assert float(out_a.loss.detach()) == float(
        out_b.loss.detach()
    )  # same weights and optimizer moments: bit-identical
    wa, wb = a.weights(), b.weights()
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == set(wa)  # exactly the HF checkpoint names
    for k in wa:
        assert wa[k].dtype == torch.float32 and torch.equal(wa[k], wb[k])


def test_combine_metrics_token_weighted() -> None:
    parts = [{"num_tokens": 3.0, "invalid_tokens": 1.0, "kl_k3": 0.1, "sc_tail_ratio_max": 2.0, "ess": 0.9},
             {"num_tokens": 1.0, "invalid_tokens": 0.0, "kl_k3": 0.5, "sc_tail_ratio_max": 3.0, "ess": 0.5}]  # fmt: skip
    out = combine_metrics(parts)
    assert out == {
        "num_tokens": 4.0,
        "invalid_tokens": 1.0,
        "kl_k3": (0.3 + 0.5) / 4,
        "sc_tail_ratio_max": 3.0,
    }


def test_batch_smaller_than_world_is_a_clear_error(tmp_path: Path) -> None:
    backend = HFBackend.from_pretrained(tiny_qwen3(tmp_path / "q"), OBJECTIVE, optim=OPTIM, device="cpu")
    backend.world = 4  # the split rule alone (no process group needed)
    try:
        backend.local_sequences(make_batch(num_seqs=3))
    except ValueError as exc:
        assert "3 sequences cannot be split over 4" in str(exc)
    else:
        raise AssertionError("no error")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu_tracks_the_fp32_cpu_loss(tmp_path: Path) -> None:
    """On a GPU the forward runs in bf16 (fp32 master weights): the loss is the fp32 one to bf16 accuracy."""
    ckpt = tiny_qwen3(tmp_path / "q")
    flat = make_batch(seed=5)
    cpu, _ = HFBackend.from_pretrained(ckpt, OBJECTIVE, optim=OPTIM, device="cpu").train_step(flat, GROUPS)
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
    from rlfleet.trainer.batching import flatten_groups
    from rlfleet.trainer.environments import load_environment
    from rlfleet.trainer.prompts import open_prompt_source
    from rlfleet.trainer.rollout import PromptGroup, RolloutDriver

    tok = build_chat_tokenizer()
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": "5"}) + "\n")
    prompts = open_prompt_source(str(tmp_path / "p.jsonl"), "math", tokenizer=tok, vocab_size=len(tok))
    env = load_environment("rlfleet.trainer.environments:MathEnv", tokenizer=tok)
    replies = [tok.encode(t) + [tok.eos_token_id] for t in ("The answer is \\boxed{5}.", "It is 7")]

    async def generate(session: str, ids: list[int], params: dict) -> SampledTurn:
        out = np.asarray(replies[int(session.split("/")[1])])
        n = len(out)
        other = (out + 1) % len(tok)
        return SampledTurn(prompt_ids=np.asarray(ids), output_ids=out, logprobs=np.full(n, np.log(0.5)),
                           sampled_logprobs=np.full(n, np.log(0.6)), support_offsets=np.arange(0, 2 * n + 1, 2),
                           support_ids=np.stack([out, other], 1).reshape(-1),
                           support_logprobs=np.tile(np.log([0.6, 0.4]), n).astype(np.float32),
                           weight_versions=np.zeros(n, dtype=np.int64), group="h100-fp8", finish_reason="stop")  # fmt: skip

    driver = RolloutDriver(
        generate, env, prompts, samples_per_prompt=2, sampling={"max_new_tokens": 32}, max_seq_len=128
    )
    prompt = prompts.get(0)
    rollouts = [asyncio.run(driver.run_episode(prompt, k)) for k in range(2)]
    assert [r.outcome.reward for r in rollouts] == [1.0, 0.0]
    flat = flatten_groups([PromptGroup(prompt=prompt, rollouts=rollouts)], trainer_version=0)
    assert flat.target_ids.tolist() == replies[0] + replies[1]

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    backend = HFBackend.from_pretrained(tmp_path / "m", OBJECTIVE, optim=OPTIM, device="cpu")
    out, grad_norm = backend.train_step(flat, {"h100-fp8": 0})
    assert out.metrics["num_tokens"] == len(replies[0]) + len(replies[1]) and grad_norm > 0
