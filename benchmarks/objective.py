"""Benchmark: time and peak memory of the corrected objective's forward + backward.

Every case runs in a FRESH subprocess (peak memory is a per-process high-water mark), on the same
random logits [T, V] (float32 by default, seed 0), and reports:

- time: forward + backward as a ratio to a plain token-level PG loss (log_softmax + gather) timed in
  the SAME subprocess, interleaved with the case. Both CPU time of the process (user + sys, which
  includes page faults; with one torch thread it is what the work costs, unaffected by neighbours
  taking the wall clock on a shared machine) and wall time are recorded, each as the minimum over
  --reps (interference only ever adds time);
- memory: the Linux peak resident set (VmHWM) during the first forward + backward, minus the resident
  set just before it (which already holds the logits): the extra memory the loss needs, including
  the [T, V] gradient. The peak is reset with /proc/self/clear_refs first. This sees every torch CPU
  allocation because large tensors are their own mmap'd pages, returned to the OS when freed.

Baselines: `pg_plain` (log_softmax + gather) and `sc_naive` (score centering with q scattered into a
dense [T, V] tensor). Cases: the four modes with support replay (K = --support-k) and with a
full-vocabulary head (K = --head-k).

    .venv/bin/python benchmarks/objective.py                # T = 4096 if memory allows, else halved
    .venv/bin/python benchmarks/objective.py --tokens 1024 --markdown
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
BASELINES = ("pg_plain", "sc_naive")
MODES = ("pg", "mis", "sc", "sc_mis")
CASES = (
    BASELINES
    + tuple(f"{mode}/support-replay" for mode in MODES)
    + tuple(f"{mode}/head-full" for mode in MODES)
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
    """Logits [T, V] and a TokenBatch whose candidates are the top-K of a perturbed copy of the logits
    (a sampler slightly off the trainer), built in row chunks so setup never holds a second [T, V]."""
    import torch

    from rlfleet.trainer.objective import TokenBatch

    torch.manual_seed(0)
    tokens, k = args.tokens, (args.support_k if support else args.head_k)
    logits = torch.randn(tokens, args.vocab, dtype=getattr(torch, args.dtype)).mul_(2.0)
    cand_ids = torch.empty(tokens, k, dtype=torch.long)
    cand_logq = torch.empty(tokens, k, dtype=torch.float32)
    for start in range(0, tokens, 256):
        rows = logits[start : start + 256].float()
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
    return logits, batch


def _pg_plain(logits, batch):
    import torch

    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(batch.advantages * log_p.gather(1, batch.tokens[:, None])[:, 0]).mean()


def _sc_naive(logits, batch):
    """SC written the obvious way: q scattered into a dense [T, V], full log-softmax, centering sum."""
    import torch

    log_p = torch.log_softmax(logits.float(), dim=-1)
    q_dense = torch.zeros_like(log_p).scatter_(1, batch.candidate_ids, batch.candidate_logprobs.exp())
    centering = (q_dense * log_p).sum(dim=1)
    return -(batch.advantages * (log_p.gather(1, batch.tokens[:, None])[:, 0] - centering)).mean()


def run_case(args) -> dict:
    import torch

    from rlfleet.trainer.objective import ObjectiveConfig, policy_loss

    torch.set_num_threads(args.threads)
    case = args.case
    support = case == "sc_naive" or case.endswith("support-replay") or case == "pg_plain"
    logits, batch = _make_inputs(args, support=support)
    if case == "pg_plain":
        loss_fn = _pg_plain
    elif case == "sc_naive":
        loss_fn = _sc_naive
    else:
        mode, variant = case.split("/")
        config = ObjectiveConfig(
            mode=mode, replay=variant == "support-replay", chunk_tokens=args.chunk_tokens
        )

        def loss_fn(z, b):
            return policy_loss(z, b, config).loss

    logits.requires_grad_(True)

    def step(fn) -> tuple[float, float]:
        """(CPU seconds, wall seconds) of one forward + backward."""
        logits.grad = None
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        fn(logits, batch).backward()
        elapsed = time.process_time() - start_cpu, time.perf_counter() - start_wall
        logits.grad = None
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
        "dtype": args.dtype,
        "logits_bytes": logits.numel() * logits.element_size(),
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
    """The requested T, halved until the heaviest case (naive SC: about 7 [T, V] float32 tensors)
    fits in half of the memory currently available (the machine is shared)."""
    tokens = args.tokens
    budget = _mem_available_bytes() // 2
    while tokens > 64 and 7.5 * tokens * args.vocab * 4 > budget:
        tokens //= 2
    return tokens


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _run_cases(cases: list[str], tokens: int, args: argparse.Namespace) -> dict[str, dict] | None:
    """Each case in its own process (a clean peak-memory reading); None after printing a failed case."""
    results: dict[str, dict] = {}
    for case in cases:
        command = [
            sys.executable, os.path.abspath(__file__), "--case", case, "--tokens", str(tokens),
            "--vocab", str(args.vocab), "--support-k", str(args.support_k), "--head-k", str(args.head_k),
            "--reps", str(args.reps), "--threads", str(args.threads), "--chunk-tokens", str(args.chunk_tokens),
            "--dtype", args.dtype,
        ]  # fmt: skip
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
        "--tokens", type=int, default=4096, help="T (halved automatically if memory is short)"
    )
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--support-k", type=int, default=64)
    parser.add_argument("--head-k", type=int, default=128)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads per case (the machine is shared)"
    )
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    for baseline in BASELINES:  # ratios need both baselines
        if baseline not in cases:
            cases.insert(0, baseline)
    tokens = args.tokens if args.no_shrink else _choose_tokens(args)
    if tokens != args.tokens:
        print(
            f"note: T shrunk from {args.tokens} to {tokens} to fit half of MemAvailable ({_gib(_mem_available_bytes())} GiB)"
        )
    results = _run_cases(cases, tokens, args)
    if results is None:
        return 1

    pg, naive = results["pg_plain"], results["sc_naive"]
    naive_cpu_ratio = naive["cpu_s"] / naive["pg_plain_cpu_s"]
    rows = []
    for case, r in results.items():
        cpu_vs_pg = r["cpu_s"] / r["pg_plain_cpu_s"]
        rows.append(
            [
                case,
                f"{r['cpu_s']:.2f}",
                f"{cpu_vs_pg:.2f}x",
                f"{r['wall_s'] / r['pg_plain_wall_s']:.2f}x",
                f"{cpu_vs_pg / naive_cpu_ratio:.2f}x",
                _gib(r["extra_peak_bytes"]),
                f"{r['extra_peak_bytes'] / pg['extra_peak_bytes']:.2f}x",
                f"{(r['rss_before_bytes'] + r['extra_peak_bytes']) / (pg['rss_before_bytes'] + pg['extra_peak_bytes']):.2f}x",
                f"{naive['extra_peak_bytes'] / max(r['extra_peak_bytes'], 1):.2f}x",
            ]
        )
    header = [
        "case",
        "CPU s",
        "CPU / pg_plain",
        "wall / pg_plain",
        "CPU / sc_naive",
        "extra peak GiB",
        "extra / pg_plain",
        "total peak / pg_plain",
        "sc_naive extra / this",
    ]
    print(f"T={tokens} V={args.vocab} support K={args.support_k} head K={args.head_k} dtype={args.dtype} "
          f"threads={args.threads} chunk={args.chunk_tokens} logits {_gib(pg['logits_bytes'])} GiB")  # fmt: skip
    _print_table(header, rows, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
