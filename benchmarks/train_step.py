"""Benchmark: peak memory and tokens/s of ONE train step of the transformers backend (issue 28, item 4)
on the tiny Qwen3 geometry (rlfleet/tiny_qwen3.py: 2 layers, hidden 128) with the real Qwen3 vocabulary
(151,936), before vs after, in the same run:

- `after`: the backend's real step (trainer/backends/backend_hf.py `HFBackend.train_step`): packed token-budget
  micro-batches, the fused lm_head + objective (never [T, V]), gradient accumulation, clip, AdamW;
- `before`: the step the backend took before issue 28, rebuilt here from its parts: ONE forward of the
  whole batch padded to its longest sequence, the logits of every position from the first sampled one
  (`logits_to_keep`) gathered at the sampled rows ([T, V]), the objective on materialised logits
  (tests/objective/materialized.py, the tests' reference, imported by path: it lives with the tests
  because production never calls it), backward, clip, AdamW;
- `decoder`: the decoder alone (forward of the packed row to the final hidden states, backward of their
  sum): the hidden states and activations of the micro-batch, the yardstick of the issue's target
  (the after step's extra peak at most 2x this);
- `padded-fused` (batch only): the before layout (one padded forward) with the fused objective, to
  separate the cost of padding from the cost of the logits;
- `packed-mask` (batch only): the backend's step with transformers' own sdpa on the packed row (a dense
  [L, L] block-causal mask, every pair of positions computed) instead of the backend's per-sequence
  attention (trainer/backends/attention.py): what packing cost before that.

Every case runs in a FRESH subprocess (peak memory is a per-process high-water mark). Memory: the
Linux peak resident set (VmHWM, reset through /proc/self/clear_refs) during the measured step minus
the resident set just before it, i.e. the step's extra memory (gradients, activations, logits); the
model and the AdamW moments already exist (a warm-up step on a 32-token batch allocates them first).
Time: wall and CPU seconds of a step (CPU time: user + sys of the process), the minimum over --reps
steps for cases up to 16K tokens (the first is the memory measurement), one step above; tokens/s is
the trajectory's tokens / wall seconds. A `before` case whose logits would not fit in the memory available
is not run: the table says what it would need.

The batch: 64 trajectories, lengths lognormal (seeded), the padding waste of the one-forward padded
layout (padded tokens / real tokens - 1) against the packed micro-batches of `plan_micro_batches`.

    .venv/bin/python benchmarks/train_step.py --markdown
    .venv/bin/python benchmarks/train_step.py --tokens 4096,16384 --vocab 16384 --no-batch
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from objective import _gib, _mem_available_bytes, _print_table, _reset_peak, _status_kib

VOCAB = 151_936
PROMPT = 64  # prompt tokens of each trajectory (no sampled row)
SUPPORT_K = 8  # candidates per sampled token (the sampled one included), q renormalised on them
GROUP = "bench"
REPEAT_UP_TO = 16384  # tokens: cases up to this size time --reps steps (the minimum); larger ones one


# ----------------------------------------------------------------------------------------------
# Inputs (pure builders).
# ----------------------------------------------------------------------------------------------


def make_flat_batch(lengths: list[int], vocab: int, seed: int):
    """A FlatBatch of trajectories of `lengths` tokens (right-padded): a PROMPT-token prompt (or half the
    trajectory, if shorter), every later token sampled with a support of SUPPORT_K candidates."""
    import numpy as np

    from rlfleet.records import SUPPORT_MODE
    from rlfleet.trainer.rollout.batching import FlatBatch

    rng = np.random.default_rng(seed)
    lens = np.asarray(lengths, dtype=np.int64)
    input_ids = np.zeros((len(lens), int(lens.max())), dtype=np.int64)
    seq, pos = [], []
    for b, n in enumerate(lens.tolist()):
        input_ids[b, :n] = rng.integers(3, vocab, size=n)
        start = min(PROMPT, n // 2)
        seq.append(np.full(n - start, b, dtype=np.int64))
        pos.append(np.arange(start - 1, n - 1, dtype=np.int64))  # the logit position of token s is s - 1
    row_seq, row_pos = np.concatenate(seq), np.concatenate(pos)
    rows = len(row_seq)
    targets = input_ids[row_seq, row_pos + 1]
    cand_ids = (targets[:, None] + np.arange(SUPPORT_K)[None, :]) % vocab  # distinct, the target first
    logits = rng.normal(size=(rows, SUPPORT_K)).astype(np.float32)
    cand_logq = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    advantages = np.repeat(
        rng.normal(size=len(lens)).astype(np.float32), lens - np.minimum(PROMPT, lens // 2)
    )
    return FlatBatch(
        input_ids=input_ids,
        seq_lens=lens,
        row_seq=row_seq,
        row_pos=row_pos,
        target_ids=targets,
        advantages=advantages,
        logq=cand_logq[:, 0] - 0.1,
        logq_support=cand_logq[:, 0],
        cand_offsets=np.arange(rows + 1, dtype=np.int64) * SUPPORT_K,
        cand_ids=cand_ids.reshape(-1),
        cand_logq=cand_logq.reshape(-1),
        candidate_mode=SUPPORT_MODE,
        versions=np.zeros(rows, dtype=np.int64),
        staleness=np.zeros(rows, dtype=np.int64),
        groups=np.full(rows, GROUP, dtype=object),
    )


def batch_lengths(count: int, median: int, sigma: float, max_len: int, seed: int) -> list[int]:
    """`count` trajectory lengths, lognormal (long-tailed, as agentic rollouts) around `median`, in [16, max_len]."""
    import numpy as np

    draws = np.random.default_rng(seed).lognormal(mean=np.log(median), sigma=sigma, size=count)
    return [int(x) for x in np.clip(np.round(draws), 16, max_len)]


def padding_waste(lengths: list[int], max_tokens: int) -> dict[str, float]:
    """Padded tokens / real tokens of one padded forward of the batch, and of the packed micro-batches."""
    import numpy as np

    from rlfleet.trainer.rollout.batching import needed_lengths, plan_micro_batches

    flat = make_flat_batch(lengths, vocab=64, seed=0)
    needed = needed_lengths(flat)
    real = int(needed.sum())
    plan = plan_micro_batches(flat, np.arange(len(lengths)), max_tokens)
    return {
        "real_tokens": real,
        "one_forward_tokens": len(lengths) * int(max(lengths)),
        "packed_tokens": sum(mb.num_tokens for mb in plan),
        "micro_batches": len(plan),
        "longest": int(max(lengths)),
    }


def before_bytes(lengths: list[int], vocab: int) -> int:
    """What the before step's logits cost: the kept logits [B, keep, V], their copy at the rows, and the
    gradients of both (float32)."""
    keep = max(lengths) - min(min(PROMPT, n // 2) for n in lengths) + 1
    rows = sum(n - min(PROMPT, n // 2) for n in lengths)
    return 2 * 4 * vocab * (len(lengths) * keep + rows)


# ----------------------------------------------------------------------------------------------
# One case, inside its own process.
# ----------------------------------------------------------------------------------------------


def _model(vocab: int, max_len: int):
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

    return tiny_model(TinyQwen3(vocab_size=vocab, max_position_embeddings=max(max_len, 256))).train()


def _before_step(model, optimizer, flat, objective, max_grad_norm: float) -> None:
    """The step before issue 28 (trainer/backends/backend_hf.py at 204addb^ `row_logits` + `_train_step`)."""
    import numpy as np
    import torch
    from materialized import materialized_policy_loss

    from rlfleet.trainer.backends.backend_common import to_token_batch

    optimizer.zero_grad(set_to_none=True)
    first = int(flat.row_pos.min())
    keep = int(flat.input_ids.shape[1]) - first
    logits = model(input_ids=torch.from_numpy(flat.input_ids), logits_to_keep=keep, use_cache=False).logits
    rows = logits[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos - first)].float()
    del logits
    out = materialized_policy_loss(rows, to_token_batch(flat, {GROUP: 0}), objective)
    out.loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if np.isfinite(norm):
        optimizer.step()


def _padded_fused_step(model, optimizer, flat, objective, max_grad_norm: float) -> None:
    """The before layout (one padded forward of the whole batch) with the fused lm_head + objective."""
    import numpy as np
    import torch

    from rlfleet.trainer.backends.backend_common import to_token_batch
    from rlfleet.trainer.objective import policy_loss

    optimizer.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=torch.from_numpy(flat.input_ids), use_cache=False).last_hidden_state
    rows = hidden[torch.from_numpy(flat.row_seq), torch.from_numpy(flat.row_pos)]
    policy_loss(rows, model.lm_head.weight, to_token_batch(flat, {GROUP: 0}), objective).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    if np.isfinite(norm):
        optimizer.step()


def _decoder_step(model, flat) -> None:
    """The decoder's forward and backward alone, on the packed row of every sequence (no objective)."""
    import numpy as np
    import torch

    from rlfleet.trainer.rollout.batching import plan_micro_batches

    model.zero_grad(set_to_none=True)
    (mb,) = plan_micro_batches(flat, np.arange(flat.input_ids.shape[0]), 1 << 30)
    input_ids, position_ids, _ = mb.packed(flat)
    hidden = model.model(
        input_ids=torch.from_numpy(input_ids)[None],
        position_ids=torch.from_numpy(position_ids)[None],
        use_cache=False,
    ).last_hidden_state
    hidden.sum().backward()


def run_case(args) -> dict:
    import torch

    from rlfleet.trainer.backends.attention import use_varlen_attention
    from rlfleet.trainer.backends.backend_common import OptimConfig
    from rlfleet.trainer.backends.backend_hf import HFBackend
    from rlfleet.trainer.objective import ObjectiveConfig

    torch.set_num_threads(args.threads)
    path, lengths = args.case, [int(n) for n in args.lengths.split(",")]
    flat, warm = make_flat_batch(lengths, args.vocab, seed=1), make_flat_batch([32], args.vocab, seed=2)
    objective, optim = ObjectiveConfig(), OptimConfig(learning_rate=1e-5)
    model = _model(args.vocab, max(lengths))
    if path in ("after", "packed-mask"):
        backend = HFBackend(
            model, objective, optim=optim, device="cpu", max_tokens_per_micro_batch=args.max_tokens
        )
        if path == "packed-mask":
            backend.model.set_attn_implementation("sdpa")
            assert backend.model.config._attn_implementation == "sdpa"

        def step(batch) -> None:
            backend.train_step(batch, {GROUP: 0})
    elif path == "decoder":
        use_varlen_attention(model)  # the backend's attention

        def step(batch) -> None:
            _decoder_step(model, batch)
    else:
        sys.path.insert(
            0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "objective")
        )
        optimizer = optim.adamw(model.parameters())
        one = _before_step if path == "before" else _padded_fused_step

        def step(batch) -> None:
            one(model, optimizer, batch, objective, optim.max_grad_norm)

    step(warm)  # the AdamW moments exist from here on: the measured step's extra memory is its own
    rss_before_kib = _status_kib("VmRSS")
    _reset_peak()
    times = []
    for _ in range(args.reps if sum(lengths) <= REPEAT_UP_TO else 1):  # the first is the memory measurement
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        step(flat)
        times.append((time.process_time() - start_cpu, time.perf_counter() - start_wall))
        if len(times) == 1:
            peak_kib = _status_kib("VmHWM")
    cpu_s, wall_s = min(cpu for cpu, _ in times), min(wall for _, wall in times)
    return {
        "case": path,
        "tokens": int(sum(lengths)),
        "vocab": args.vocab,
        "cpu_s": cpu_s,
        "wall_s": wall_s,
        "extra_peak_bytes": (peak_kib - rss_before_kib) * 1024,
        "rss_before_bytes": rss_before_kib * 1024,
    }


# ----------------------------------------------------------------------------------------------
# The driver.
# ----------------------------------------------------------------------------------------------


def _run(case: str, lengths: list[int], args: argparse.Namespace) -> dict | None:
    """One case in its own process; None (after printing why) if it failed or ran past --case-timeout."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--case",
        case,
        "--lengths",
        ",".join(map(str, lengths)),
        "--vocab",
        str(args.vocab),
        "--threads",
        str(args.threads),
        "--max-tokens",
        str(args.max_tokens),
        "--reps",
        str(args.reps),
    ]
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=args.case_timeout)
    except subprocess.TimeoutExpired:
        print(f"  {case} T={sum(lengths)}: over {args.case_timeout} s, stopped", file=sys.stderr)
        return None
    if completed.returncode != 0:
        print(
            f"  {case} T={sum(lengths)} failed (exit {completed.returncode}):\n{completed.stderr[-1500:]}",
            file=sys.stderr,
        )
        return None
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    print(
        f"  done {case} T={result['tokens']}: {result['wall_s']:.1f} s wall, extra peak "
        f"{_gib(result['extra_peak_bytes'])} GiB",
        file=sys.stderr,
    )
    return result


def _fits(lengths: list[int], args: argparse.Namespace) -> tuple[bool, int]:
    need = before_bytes(lengths, args.vocab)
    return need < 0.8 * _mem_available_bytes(), need


def _cell(result: dict | None, key: str, fmt: str) -> str:
    return "-" if result is None else format(result[key], fmt)


def _ratio(a: dict | None, b: dict | None, key: str, invert: bool = False) -> str:
    if a is None or b is None or not b[key] or not a[key]:
        return "-"
    return f"{(b[key] / a[key]) if invert else (a[key] / b[key]):.2f}x"


def single_trajectory_table(args: argparse.Namespace) -> None:
    header = [
        "T",
        "after GiB",
        "after tok/s",
        "decoder GiB",
        "after / decoder",
        "before GiB",
        "before tok/s",
        "after / before peak",
        "after / before tok/s",
    ]
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        lengths = [tokens]
        after, decoder = _run("after", lengths, args), _run("decoder", lengths, args)
        fits, need = _fits(lengths, args)
        before = _run("before", lengths, args) if fits else None
        for r in (after, before):
            if r is not None:
                r["tok_s"] = r["tokens"] / r["wall_s"]
        rows.append(
            [
                str(tokens),
                _gib(after["extra_peak_bytes"]) if after else "-",
                _cell(after, "tok_s", ".0f"),
                _gib(decoder["extra_peak_bytes"]) if decoder else "-",
                _ratio(after, decoder, "extra_peak_bytes"),
                _gib(before["extra_peak_bytes"]) if before else f"not run: needs {_gib(need)} GiB",
                _cell(before, "tok_s", ".0f"),
                _ratio(after, before, "extra_peak_bytes"),
                _ratio(after, before, "tok_s"),
            ]
        )
    print(
        f"\nOne trajectory: V={args.vocab} tiny Qwen3 (H=128, 2 layers) float32 CPU threads={args.threads} "
        f"maxTokensPerMicroBatch={args.max_tokens}; GiB = extra peak RSS of the step"
    )
    _print_table(header, rows, args.markdown)


def batch_table(args: argparse.Namespace) -> None:
    lengths = batch_lengths(64, args.batch_median, args.batch_sigma, args.batch_max, seed=0)
    waste = padding_waste(lengths, args.max_tokens)
    real = waste["real_tokens"]
    print(
        f"\nBatch: 64 trajectories, lognormal(median {args.batch_median}, sigma {args.batch_sigma}, seed 0, "
        f"in [16, {args.batch_max}]): {real} tokens trained through, longest {waste['longest']}"
    )
    print(
        f"padding waste (padded / real - 1): one padded forward {waste['one_forward_tokens'] / real - 1:.2f} "
        f"({waste['one_forward_tokens']} tokens), packed micro-batches {waste['packed_tokens'] / real - 1:.2f} "
        f"({waste['packed_tokens']} tokens in {waste['micro_batches']} micro-batches of <= {args.max_tokens})"
    )
    fits, need = _fits(lengths, args)
    results = {
        "after": _run("after", lengths, args),
        "packed-mask": _run("packed-mask", lengths, args),
        "padded-fused": _run("padded-fused", lengths, args),
        "before": _run("before", lengths, args) if fits else None,
    }
    after = results["after"]
    rows = []
    for case, r in results.items():
        peak = (
            _gib(r["extra_peak_bytes"])
            if r
            else (f"not run: needs {_gib(need)} GiB" if case == "before" else "-")
        )
        rows.append(
            [
                case,
                peak,
                _cell(r, "wall_s", ".1f"),
                _cell(r, "cpu_s", ".1f"),
                _ratio(r, after, "wall_s") if case != "after" else "1.00x",
            ]
        )
    _print_table(["step", "extra peak GiB", "wall s", "CPU s", "time / after"], rows, args.markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", default="4096,16384,65536", help="comma-separated T of the one-trajectory cases"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads per case (the machine is shared)"
    )
    parser.add_argument(
        "--reps", type=int, default=2, help="steps timed per case up to 16K tokens (the minimum)"
    )
    parser.add_argument("--max-tokens", type=int, default=16384, help="trainer.maxTokensPerMicroBatch")
    parser.add_argument("--batch-median", type=int, default=256)
    parser.add_argument("--batch-sigma", type=float, default=1.0)
    parser.add_argument("--batch-max", type=int, default=4096)
    parser.add_argument("--no-batch", action="store_true", help="skip the 64-trajectory batch")
    parser.add_argument("--no-single", action="store_true", help="skip the one-trajectory cases")
    parser.add_argument("--case-timeout", type=float, default=900.0, help="seconds before a case is stopped")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    parser.add_argument("--lengths", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        print(json.dumps(run_case(args)))
        return 0
    if not args.no_single:
        single_trajectory_table(args)
    if not args.no_batch:
        batch_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
