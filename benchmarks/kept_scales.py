"""Kept scales against fresh scales over a run of Adam steps (docs/weights.md, "Kept scales").

A small Qwen3 (the project's tiny Qwen3 at larger sizes, transformers' model, fp32 master weights) takes
`--steps` Adam steps on a next-token loss over random token batches, at each learning rate. After every
step each quantized view (fp8 block-128, nvfp4 with input_scale from `calibrate_activation_amax`, as the
publisher writes them from an HF base) is made twice from the same weights: with FRESH scales (every
scale from the amax, the publisher before kept scales) and with the previous version's scales KEPT
(`view_tensors(previous_scales=...)`, the chain the publisher now follows). Printed per learning rate and
view, over the consecutive-version pairs:

- `changed_share`: changed stored elements of the quantized linears (codes and every scale tensor,
  compared bit for bit in their stored width, as rlfleet/deltas.py does) / their stored elements, fresh
  and kept: mean and worst pair, and kept / fresh;
- `delta_bytes_share`: what a delta of the whole view holds (per changed element its 4-byte index and its
  value, rlfleet/deltas.py) / the view's tensor bytes, fresh and kept;
- `error_ratio`: per quantized tensor, squared error (dequantized vs the fp32 weights) with kept scales /
  with fresh scales: mean and worst over tensors and versions (KEPT_SCALE_ERROR_BOUND bounds it);
- `convert_s`: seconds to make the view's tensors, fresh and kept (kept quantizes each tensor 2-3 times).

    .venv/bin/python -P benchmarks/kept_scales.py                   # 2 layers, hidden 512, 6 steps (docs/benchmarks.md)
    .venv/bin/python -P benchmarks/kept_scales.py --steps 3 --layers 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping

import torch

from rlfleet.numerics import formats
from rlfleet.numerics.views import (
    calibrate_activation_amax,
    calibration_batch,
    checkpoint_tensors,
    scale_tensors,
    view_tensors,
)
from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

QUANTIZED_VIEWS = ("fp8", "nvfp4")
INDEX_BYTES = 4  # rlfleet/deltas.py: U32 flat indices below 2^32 elements


def stored_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of their stored width (bit-for-bit comparison, as the delta codec)."""
    flat = t.contiguous().reshape(-1)
    return flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])


def changed(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[int, int, int]:
    """(changed elements, elements, delta bytes: per changed element its index and its value) over `names`."""
    count = total = delta = 0
    for name in names:
        diff = int((stored_bits(before[name]) != stored_bits(after[name])).sum())
        count += diff
        total += after[name].numel()
        delta += diff * (INDEX_BYTES + after[name].element_size())
    return count, total, delta


def squared_error(view: str, tensors: Mapping[str, torch.Tensor], name: str, w: torch.Tensor) -> float:
    base = name[: -len(".weight")]
    if view == "fp8":
        deq = formats.dequantize_fp8_block(tensors[name], tensors[f"{base}.weight_scale_inv"])
    else:
        deq = formats.dequantize_nvfp4(
            tensors[name], tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_scale_2"]
        )
    return float((deq.double() - w.double()).square().sum())


def run(lr: float, args: argparse.Namespace) -> dict[str, dict[str, object]]:
    spec = TinyQwen3(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        head_dim=64,
        seed=0,
    )
    model = tiny_model(spec)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    tokens = torch.Generator().manual_seed(1)
    previous: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # view -> chain -> tensors
    shares: dict[str, dict[str, list[float]]] = {
        v: {"fresh": [], "kept": [], "fresh_bytes": [], "kept_bytes": []} for v in QUANTIZED_VIEWS
    }
    ratios: dict[str, list[float]] = {v: [] for v in QUANTIZED_VIEWS}
    seconds: dict[str, dict[str, list[float]]] = {v: {"fresh": [], "kept": []} for v in QUANTIZED_VIEWS}
    for step in range(args.steps + 1):
        if step:  # one optimizer step on a next-token loss over a random batch
            batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=tokens)
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            state = {k: v.detach().clone() for k, v in checkpoint_tensors(model.state_dict()).items()}
            amax = calibrate_activation_amax(model, [calibration_batch(args.vocab)])
        for view in QUANTIZED_VIEWS:
            made = {}
            for chain in ("fresh", "kept"):
                kept_scales = (
                    scale_tensors(previous[view]["kept"]) if chain == "kept" and view in previous else None
                )
                t0 = time.perf_counter()
                made[chain], quantized = view_tensors(
                    state, view, hf=True, activation_amax=amax, previous_scales=kept_scales
                )
                seconds[view][chain].append(time.perf_counter() - t0)
            if view in previous:
                linears = [
                    n for n in made["fresh"] if any(n.startswith(q[: -len("weight")]) for q in quantized)
                ]
                view_bytes = sum(t.numel() * t.element_size() for t in made["fresh"].values())
                for chain in ("fresh", "kept"):
                    count, total, _ = changed(previous[view][chain], made[chain], linears)
                    _, _, delta = changed(previous[view][chain], made[chain], sorted(made[chain]))
                    shares[view][chain].append(count / total)
                    shares[view][f"{chain}_bytes"].append(delta / view_bytes)
                for name in quantized:
                    fresh = squared_error(view, made["fresh"], name, state[name])
                    kept = squared_error(view, made["kept"], name, state[name])
                    ratios[view].append(kept / fresh if fresh else 1.0)
            previous[view] = made
    out: dict[str, dict[str, object]] = {}
    for view in QUANTIZED_VIEWS:
        s = shares[view]
        out[view] = {
            "changed_share_fresh": {"mean": statistics.mean(s["fresh"]), "worst": max(s["fresh"])},
            "changed_share_kept": {"mean": statistics.mean(s["kept"]), "worst": max(s["kept"])},
            "changed_kept_vs_fresh": statistics.mean(s["kept"]) / statistics.mean(s["fresh"]),
            "delta_bytes_share_fresh": {
                "mean": statistics.mean(s["fresh_bytes"]),
                "worst": max(s["fresh_bytes"]),
            },
            "delta_bytes_share_kept": {
                "mean": statistics.mean(s["kept_bytes"]),
                "worst": max(s["kept_bytes"]),
            },
            "error_ratio_kept_vs_fresh": {
                "mean": statistics.mean(ratios[view]),
                "worst": max(ratios[view]),
                "best": min(ratios[view]),
            },
            "convert_s": {c: statistics.median(seconds[view][c][1:]) for c in ("fresh", "kept")},
        }
    return out


def rounded(x: object) -> object:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--hidden", type=int, default=512, help="a multiple of 128 (fp8 blocks of the fused layers)"
    )
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6, help="Adam steps per learning rate (versions - 1)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-4])
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, object] = {
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "model": {
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": 3 * args.hidden,
            "vocab": args.vocab,
        },
        "steps": args.steps,
        "error_bound": formats.KEPT_SCALE_ERROR_BOUND,
    }
    for lr in args.lrs:
        report[f"lr={lr:g}"] = rounded(run(lr, args))
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
