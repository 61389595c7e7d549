"""Benchmark: time and peak memory of one forward + backward of the corrected objective, the fused
lm_head (trainer/objective.py `policy_loss(hidden, weight, ...)`: logits made tile by tile, never
[T, V]) against the path it replaced (the lm_head matmul materialising the logits [T, V], then the
objective on them: tests/objective/materialized.py), in the same run.

Every case runs in a FRESH subprocess (peak memory is a per-process high-water mark), on the same
random final hidden states [T, H] and output embedding [V, H] (float32, seed 0; H = --hidden, the
tiny Qwen3's 128 by default, V = Qwen3's 151,936), and reports:

- time: forward + backward (gradients of both the hidden states and the weight) as a ratio to a
  plain token-level PG loss on materialised logits (matmul, log_softmax, gather) timed in the SAME
  subprocess, interleaved with the case. Both CPU time of the process (user + sys; with one torch
  thread it is what the work costs, unaffected by neighbours on a shared machine) and wall time are
  recorded, each the minimum over --reps;
- memory: the Linux peak resident set (VmHWM) during the first forward + backward minus the resident
  set just before it (which already holds the hidden states and the weight): the extra memory of the
  step, including the weight's [V, H] gradient. The peak is reset with /proc/self/clear_refs first.

Cases: `pg_plain` (the baseline), `materialized/<mode>/<variant>` and `fused/<mode>/<variant>` for the
four modes, support replay (K = --support-k) and a full-vocabulary head (K = --head-k). The table
pairs each fused case with its materialised twin: fused / materialised time and extra peak.

    .venv/bin/python benchmarks/objective.py --tokens 2048 --markdown
    .venv/bin/python benchmarks/objective.py --tokens 8192 --cases fused/sc_mis/head-full,materialized/sc_mis/head-full
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VOCAB = 151_936
MODES = ("pg", "mis", "sc", "sc_mis")
VARIANTS = ("support-replay", "head-full")
CASES = ("pg_plain",) + tuple(
    f"{path}/{mode}/{variant}" for variant in VARIANTS for mode in MODES for path in ("materialized", "fused")
)


# ----------------------------------------------------------------------------------------------
# One case, inside its own process.
# ----------------------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _make_inputs(args, support: bool):
    """Hidden states [T, H], the output embedding [V, H] and a TokenBatch whose candidates are the
    top-K of a perturbed copy of the logits (a sampler slightly off the trainer), built in row chunks
    so setup never holds [T, V]."""
    import torch

    from rlfleet.trainer.objective import TokenBatch

    torch.manual_seed(0)
    tokens, k = args.tokens, (args.support_k if support else args.head_k)
    hidden = torch.randn(tokens, args.hidden)
    weight = torch.randn(args.vocab, args.hidden).mul_(2.0 / args.hidden**0.5)
    cand_ids = torch.empty(tokens, k, dtype=torch.long)
    cand_logq = torch.empty(tokens, k, dtype=torch.float32)
    for start in range(0, tokens, 256):
        rows = hidden[start : start + 256] @ weight.T
        top, ids = rows.topk(k, dim=1)
        noisy = top + 0.3 * torch.randn_like(top)
        # support: q renormalised on the support; head: q's head under the full-vocabulary normaliser
        normaliser = noisy.logsumexp(1, keepdim=True) if support else rows.logsumexp(1, keepdim=True)
        cand_ids[start : start + 256], cand_logq[start : start + 256] = ids, noisy - normaliser
    pick = torch.multinomial(cand_logq.exp(), 1)  # y ~ q over the candidates
    batch = TokenBatch(
        tokens=cand_ids.gather(1, pick)[:, 0],
        advantages=torch.randn(tokens),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        sampler_logprobs=cand_logq.gather(1, pick)[:, 0],
        candidate_ids=cand_ids,
        candidate_logprobs=cand_logq,
        candidates_are_support=support,
    )
    return hidden, weight, batch


def _pg_plain(hidden, weight, batch):
    import torch

    log_p = torch.log_softmax(hidden @ weight.T, dim=-1)
    return -(batch.advantages * log_p.gather(1, batch.tokens[:, None])[:, 0]).mean()


def _loss_fn(case: str, args):
    """The case's loss(hidden, weight, batch)."""
    from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

    if case == "pg_plain":
        return _pg_plain
    path, mode, variant = case.split("/")
    config = ObjectiveConfig(
        mode=mode,
        replay=variant == "support-replay",
        chunk_tokens=args.chunk_tokens,
        chunk_vocab=args.chunk_vocab,
    )
    if path == "fused":
        return lambda h, w, b: policy_loss(h, w, b, config).loss
    # the path the fused one replaced, kept as the tests' reference
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "objective"))
    from materialized import materialized_policy_loss

    return lambda h, w, b: materialized_policy_loss(h @ w.T, b, config).loss


def run_case(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    case = args.case
    hidden, weight, batch = _make_inputs(args, support=case == "pg_plain" or case.endswith("support-replay"))
    loss_fn = _loss_fn(case, args)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def step(fn) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of one forward + backward."""
        hidden.grad = weight.grad = None
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        fn(hidden, weight, batch).backward()
        elapsed = time.process_time() - start_cpu, time.perf_counter() - start_wall
        hidden.grad = weight.grad = None
        return elapsed

    rss_before_kib = _status_kib("VmRSS")
    _reset_peak()
    step(loss_fn)  # the first run is the memory measurement (and a warm-up)
    peak_kib = _status_kib("VmHWM")
    case_times, pg_times = [], []
    for _ in range(max(args.reps, 1)):
        pg_times.append(step(_pg_plain))
        case_times.append(step(loss_fn))
    return {
        "case": case,
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "logits_bytes": args.tokens * args.vocab * 4,
        "weight_bytes": weight.numel() * weight.element_size(),
        "rss_before_bytes": rss_before_kib * 1024,
        "extra_peak_bytes": (peak_kib - rss_before_kib) * 1024,
        "cpu_s": min(cpu for cpu, _ in case_times),
        "pg_plain_cpu_s": min(cpu for cpu, _ in pg_times),
        "wall_s": min(wall for _, wall in case_times),
        "pg_plain_wall_s": min(wall for _, wall in pg_times),
        "wall_median_s": statistics.median(wall for _, wall in case_times),
    }


# ----------------------------------------------------------------------------------------------
# The driver: choose T, run every case in a subprocess, print ratios.
# ----------------------------------------------------------------------------------------------


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _choose_tokens(args) -> int:
    """The requested T, halved until the heaviest case (the plain PG baseline on materialised logits:
    about 4 [T, V] float32 tensors) fits in half of the memory currently available (shared machine)."""
    tokens = args.tokens
    budget = _mem_available_bytes() // 2
    while tokens > 64 and 4.5 * tokens * args.vocab * 4 > budget:
        tokens //= 2
    return tokens


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _run_cases(cases: list[str], tokens: int, args: argparse.Namespace) -> dict[str, dict] | None:
    """Each case in its own process (a clean peak-memory reading); None after printing a failed case."""
    results: dict[str, dict] = {}
    for case in cases:
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--case",
            case,
            "--tokens",
            str(tokens),
            "--vocab",
            str(args.vocab),
            "--hidden",
            str(args.hidden),
            "--support-k",
            str(args.support_k),
            "--head-k",
            str(args.head_k),
            "--reps",
            str(args.reps),
            "--threads",
            str(args.threads),
            "--chunk-tokens",
            str(args.chunk_tokens),
            "--chunk-vocab",
            str(args.chunk_vocab),
        ]
        completed = subprocess.run(command, capture_output=True, text=True)
        if completed.returncode != 0:
            print(f"error: case {case} failed:\n{completed.stderr[-2000:]}", file=sys.stderr)
            return None
        results[case] = json.loads(completed.stdout.strip().splitlines()[-1])
        print(
            f"  done {case}: {results[case]['cpu_s']:.3f} CPU-s, extra peak {_gib(results[case]['extra_peak_bytes'])} GiB",
            file=sys.stderr,
        )
    return results


def _print_table(header: list[str], rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in column) for column in zip(header, *rows, strict=False)]
        for row in [header, *rows]:
            print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", type=int, default=2048, help="T (halved automatically if memory is short)"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=128, help="H (the tiny Qwen3's; Qwen3-0.6B has 1024)")
    parser.add_argument("--support-k", type=int, default=64)
    parser.add_argument("--head-k", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per case (the machine is shared)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--chunk-vocab", type=int, default=8192)
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES)
    )
    parser.add_argument(
        "--no-shrink", action="store_true", help="run the requested T even if memory looks short"
    )
    parser.add_argument("--markdown", action="store_true", help="print the result table as markdown")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = parser.parse_args(argv)

    if args.case:
        print(json.dumps(run_case(args)))
        return 0

    cases = [case for case in args.cases.split(",") if case]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        print(f"error: unknown case(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    if "pg_plain" not in cases:  # ratios need the baseline
        cases.insert(0, "pg_plain")
    tokens = args.tokens if args.no_shrink else _choose_tokens(args)
    if tokens != args.tokens:
        print(
            f"note: T shrunk from {args.tokens} to {tokens} to fit half of MemAvailable ({_gib(_mem_available_bytes())} GiB)"
        )
    results = _run_cases(cases, tokens, args)
    if results is None:
        return 1
    _print_results(results, tokens, args)
    return 0


def _print_results(results: dict[str, dict], tokens: int, args: argparse.Namespace) -> None:
    pg = results["pg_plain"]
    rows = []
    for case, r in results.items():
        twin = results.get(case.replace("fused/", "materialized/")) if case.startswith("fused/") else None
        rows.append(
            [
                case,
                f"{r['cpu_s']:.2f}",
                f"{r['cpu_s'] / r['pg_plain_cpu_s']:.2f}x",
                f"{r['wall_s'] / r['pg_plain_wall_s']:.2f}x",
                _gib(r["extra_peak_bytes"]),
                f"{r['extra_peak_bytes'] / pg['extra_peak_bytes']:.2f}x",
                f"{r['cpu_s'] / twin['cpu_s']:.2f}x" if twin else "",
                f"{r['extra_peak_bytes'] / twin['extra_peak_bytes']:.2f}x" if twin else "",
            ]
        )
    header = [
        "case",
        "CPU s",
        "CPU / pg_plain",
        "wall / pg_plain",
        "extra peak GiB",
        "extra / pg_plain",
        "CPU fused / materialized",
        "extra fused / materialized",
    ]
    print(
        f"T={tokens} V={args.vocab} H={args.hidden} support K={args.support_k} head K={args.head_k} float32 "
        f"threads={args.threads} tile={args.chunk_tokens}x{args.chunk_vocab} logits {_gib(pg['logits_bytes'])} GiB "
        f"weight {_gib(pg['weight_bytes'])} GiB"
    )
    _print_table(header, rows, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
