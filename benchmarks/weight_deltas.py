"""Benchmark of the lossless sparse deltas (rlfleet/deltas.py, issue 40). Prints RATIOS against baselines
run in the same process, on the same files.

Codec (`--only codec`, torch-free): a synthetic bf16 safetensors view of `--gb` GB (random bf16 values in
`--tensor-mb` tensors, the layout the views' writer uses) and targets with a share of its elements changed
(each in its lowest mantissa bit, as a small update changes a bf16 value; `--rates`, default 0.4% / 2% /
58%: the issue's measured bf16 rates at lr 1e-6 and 5e-4, and the share a 1.98%-per-step production run
ships). Per rate:

- encode (`encode_delta`, base and target in the page cache) and apply + verify (`apply_delta` with a
  BLAKE3 hasher fed in its own pass: what `WeightChannel.obtain_view` does per rebuilt file) in GB/s of
  FULL view;
- baselines: a plain copy of the full file (`shutil.copyfile`, page cache), the BLAKE3 of it (one
  thread), and download + verify: `Store.get_file` of the full file (what a sidecar pays per full
  version) from a filesystem store on the same disk, and with `--s3` from a moto_server S3 store;
- ratios: apply + verify / copy, apply + verify / download + verify, delta bytes / full bytes, and the
  link speed up to which apply + verify stays at most 0.3x a download over that link (size / link);
- memory of encode: the peak of the process's anonymous resident memory (RssAnon, sampled every 5 ms)
  above its level before, and numpy's peak allocation (tracemalloc): the mapped files' page-cache pages
  are not counted (they are the kernel's, shared, and dropped under pressure).

The timings of one rate are taken round-robin (copy, hash, encode, apply, then again), the median of
`--reps` shown, so that a neighbour's burst of disk or CPU hits every operation alike. Nothing is fsynced
(a download is not either: the sidecar's copy is a cache verified at every use).

Shards (`--only shards`): a view of `--shards` files (`--gb` in all) in one store, v0 an anchor, v1 a delta
of every shard at the first `--rates`: `WeightChannel.obtain_view` of v1 from a held v0 (apply + verify)
and of v0 fresh (download + verify), with 1 and `--workers` files at once (`download_workers`).

Fan-out (`--only fanout`): one store (a filesystem directory, or `--s3`: a moto_server process over real
HTTP), `--subscribers` processes that each hold the previous version (as sidecars do), and a view of
`--fanout-mb` MB of bf16. Version 1 is published whole (an anchor), version 2 as a delta of 0.4% of the
elements changed (`encode_delta` + `WeightChannel.publish(deltas=)`, as the trainer's publisher does);
for each, the time from the start of the publish until every subscriber holds the verified version
(`WeightChannel.obtain_view` with its previous copy as `local`), and the bytes each read from the store.

    nice -n 5 .venv/bin/python -P benchmarks/weight_deltas.py --only codec --s3        # 1 GB view, 3 rates
    nice -n 5 .venv/bin/python -P benchmarks/weight_deltas.py --only codec --gb 0.25 --reps 1   # quick
    nice -n 5 .venv/bin/python -P benchmarks/weight_deltas.py --only fanout --subscribers 16

Run (`--only run`): the project's tiny Qwen3 (rlfleet/tiny_qwen3.py, fp32 master weights; by default
hidden 512, intermediate 1536, 4 layers) trained
`--steps` Adam steps on a next-token loss over random tokens at each `--lrs` (default 1e-6, the example
trainer's, and 5e-4, the demo's), every step published by the trainer's own `WeightPublisher` (bf16, fp8,
nvfp4 views; anchorEvery 16, maxDeltaShare 0.5) into a filesystem channel: per view, each delta version's
stored bytes as a share of the complete view (mean and worst; and of the safetensors files alone: the
tiny model's config and tokenizer, stored whole in every version, weigh on its shares as they would not
on a real model's), the anchors it stored instead, and the publisher's encode time per GB of view.

Scaled (`--scale-from RESULTS.json`, the `--json` of a run): the measured rates applied to a
Qwen3-30B-A3B-sized fleet of 8 groups x 2 replicas (four bf16 groups, two fp8, two nvfp4: `FLEET`), the
views' sizes the issue's 35B figures scaled by 30.5/35, the delta shares from the issue's measured
element rates at lr 1e-6 (a changed element costs its value and its gap-coded index: `gap_bytes`), an anchor every
16 versions: bytes moved and seconds per version, full against deltas, per replica link `--link-gbps`; the
fleet's row: every replica at once, bounded by the slowest replica or by the store's total egress
`--store-gbps` (an object store's bucket or an NFS server serving all 16).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from rlfleet.deltas import apply_delta, encode_delta, read_header

GB = 1e9
CHUNK = 1 << 24  # elements generated per pass


def write_view(path: Path, gb: float, tensor_mb: int, seed: int = 0) -> int:
    """A bf16 safetensors file of about `gb` GB: tensors of `tensor_mb` MB of random bf16 values (the upper
    half of float32 normal draws at std 0.02, like trained projections). Returns its size."""
    rng = np.random.default_rng(seed)
    per_tensor = tensor_mb * (1 << 20) // 2
    count = max(1, round(gb * GB / (per_tensor * 2)))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for i in range(count):
        begin = i * per_tensor * 2
        header[f"model.layers.{i}.mlp.up_proj.weight"] = {
            "dtype": "BF16",
            "shape": [per_tensor // 1024, 1024],
            "data_offsets": [begin, begin + per_tensor * 2],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _ in range(count):
            for at in range(0, per_tensor, CHUNK):
                n = min(CHUNK, per_tensor - at)
                values = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32) >> 16
                f.write(values.astype("<u2").tobytes())
    return path.stat().st_size


def write_target(base: Path, target: Path, rate: float, seed: int) -> int:
    """`base` with a share `rate` of its bf16 elements changed in the lowest mantissa bit. Returns the
    number changed."""
    rng = np.random.default_rng(seed)
    shutil.copyfile(base, target)
    mm = np.memmap(target, dtype=np.uint8, mode="r+")
    data = mm[read_header(target).data_start :].view("<u2")
    changed = 0
    for at in range(0, len(data), CHUNK):
        part = data[at : at + CHUNK]
        mask = rng.random(len(part), dtype=np.float32) < rate
        part[mask] ^= 1
        changed += int(mask.sum())
    mm.flush()
    del mm
    return changed


def copy(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)


def into_new(dst: Path, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` (which writes `dst`) with `dst` removed first, as a sidecar writes each version into a new
    directory: renaming a file over an existing one makes ext4 flush the new one first (auto_da_alloc),
    which here cost 0.18 s of a 0.27 GB apply, so every timed op writes a new file."""

    def run() -> object:
        dst.unlink(missing_ok=True)
        return fn()

    return run


def b3(path: Path) -> str:
    return blake3.blake3(max_threads=1).update_mmap(path).hexdigest()


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_robin(ops: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each op over `reps` rounds, the ops run in turn within each round."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, fn in ops.items():
            times[name].append(seconds(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak RssAnon above the level before, peak traced allocation) while `fn` runs."""
    before = rss_anon_bytes()
    peak = before
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_anon_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return max(0, max(peak, rss_anon_bytes()) - before), traced


def applied_digest(base: Path, delta: Path, out: Path) -> str:
    """Apply + verify, as WeightChannel.obtain_view does per rebuilt file: the digest fed in the apply's pass."""
    hasher = blake3.blake3()
    apply_delta(base, delta, out, hasher=hasher)
    return hasher.hexdigest()


def codec(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from rlfleet.store import FilesystemStore, open_store

    work.mkdir(parents=True)
    base = work / "base.safetensors"
    size = write_view(base, args.gb, args.tensor_mb)
    header = read_header(base)
    elements = (size - header.data_start) // 2
    print(
        f"synthetic bf16 view: {size / GB:.3f} GB, {len(header.tensors)} tensors of {args.tensor_mb} MiB",
        flush=True,
    )
    # the full view in a store on this filesystem (and with --s3 in moto's): what a sidecar downloads
    (work / "store").mkdir()
    stores: dict[str, Any] = {"filesystem": FilesystemStore(work / "store")}
    if args.store_uri:
        stores["s3"] = open_store(args.store_uri)
    for store in stores.values():
        store.put_file("v1/model.safetensors", base)
    download = {
        name: into_new(
            work / f"download-{name}",
            functools.partial(store.get_file, "v1/model.safetensors", work / f"download-{name}"),
        )
        for name, store in stores.items()
    }
    rows = []
    for rate in args.rates:
        target = work / "target.safetensors"
        changed = write_target(base, target, rate, seed=int(rate * 1e6))
        out, rebuilt = work / "delta", work / "rebuilt"
        stats = encode_delta(base, target, out)
        assert stats is not None and stats.changed_elements == changed, (
            "the delta lists every changed element"
        )
        encode = functools.partial(encode_delta, base, target, out)
        apply_verify = into_new(rebuilt, functools.partial(applied_digest, base, out, rebuilt))
        ops = {
            "copy": into_new(work / "copy", functools.partial(copy, base, work / "copy")),
            "hash": functools.partial(b3, work / "copy"),
            "encode": encode,
            "apply_verify": apply_verify,
            **{f"download_verify_{name}": fn for name, fn in download.items()},
        }
        t = round_robin(ops, args.reps)
        assert apply_verify() == b3(target), (
            "apply(encode) is the target, byte for byte, and so is its digest"
        )
        rss, traced = peak_memory(encode)
        # what a publisher with maxDeltaShare 0.5 pays before it stores an anchor instead
        t_capped = statistics.median(
            seconds(functools.partial(encode_delta, base, target, out, max_delta_bytes=size // 2))
            for _ in range(args.reps)
        )
        t_apply, t_fs = t["apply_verify"], t["download_verify_filesystem"]
        row = {
            "rate": rate,
            "changed": changed / elements,
            "delta_share": stats.delta_bytes / size,
            "encode_gbps": size / GB / t["encode"],
            "encode_vs_copy": t["encode"] / t["copy"],
            "apply_verify_gbps": size / GB / t_apply,
            "apply_verify_vs_copy": t_apply / t["copy"],
            "apply_verify_vs_download_verify": t_apply / t_fs,
            # a download over a link of L GB/s hashed as it lands takes about size / L: at most 0.3x below this
            "link_gb_per_s_for_0_3x": size / GB / (t_apply / 0.3),
            "encode_capped_s": t_capped,
            "copy_gbps": size / GB / t["copy"],
            "hash_gbps": size / GB / t["hash"],
            "download_verify_gbps": size / GB / t_fs,
            "encode_rss_mb": rss / 2**20,
            "encode_traced_mb": traced / 2**20,
            "encode_rss_per_gb": rss / 2**20 / (size / GB),
        }
        if "download_verify_s3" in t:
            row["s3_download_verify_gbps"] = size / GB / t["download_verify_s3"]
            row["apply_verify_vs_s3_download_verify"] = t_apply / t["download_verify_s3"]
        rows.append(row)
        s3 = (
            f", {row['apply_verify_vs_s3_download_verify']:.2f}x an S3 download+verify"
            if "apply_verify_vs_s3_download_verify" in row
            else ""
        )
        print(
            f"changed {row['changed']:7.3%}  delta {row['delta_share']:7.3%} of the view  "
            f"encode {row['encode_gbps']:5.2f} GB/s ({row['encode_vs_copy']:.2f}x copy)  "
            f"apply+verify {row['apply_verify_gbps']:5.2f} GB/s ({row['apply_verify_vs_copy']:.2f}x copy, "
            f"{row['apply_verify_vs_download_verify']:.2f}x download+verify from a filesystem store{s3}; "
            f"0.3x of a download over links up to {row['link_gb_per_s_for_0_3x'] * 8:.1f} Gbit/s)  "
            f"encode memory +{row['encode_rss_mb']:.0f} MB anon (numpy peak {row['encode_traced_mb']:.0f} MB)  "
            f"capped at 50% of the view: {t_capped / t['encode']:.2f}x the full encode",
            flush=True,
        )
        print(
            f"    baselines: copy {row['copy_gbps']:.2f} GB/s, BLAKE3 (1 thread) {row['hash_gbps']:.2f} GB/s, "
            f"download+verify {row['download_verify_gbps']:.2f} GB/s (filesystem store)"
            + (
                f", {row['s3_download_verify_gbps']:.2f} GB/s (S3)"
                if "s3_download_verify_gbps" in row
                else ""
            ),
            flush=True,
        )
        for p in (target, out, rebuilt):
            p.unlink(missing_ok=True)
    return rows


# ------------------------------------------------------------------------------------------------ fan-out


def _subscriber(
    store_uri: str, version: int, previous: int | None, root: str, index: int
) -> tuple[float, dict[str, int]]:
    """One sidecar's pull: the verified view of `version` from its copy of `previous`; (the time it
    finished, bytes read by kind)."""
    from rlfleet.channel import WeightChannel
    from rlfleet.store import open_store

    channel = WeightChannel(open_store(store_uri), publisher_id=f"reader-{index}")
    mine = Path(root) / f"sub{index}"
    local = {} if previous is None else {previous: mine / f"v{previous}"}
    got = channel.obtain_view(version, "bf16", mine / f"v{version}", local=local)
    return time.time(), got.read_bytes


def fanout(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from concurrent.futures import ProcessPoolExecutor

    from rlfleet.channel import DeltaSource, WeightChannel
    from rlfleet.store import open_store

    store_uri = args.store_uri or str(work / "store")
    if not args.store_uri:
        (work / "store").mkdir(parents=True)
    channel = WeightChannel(open_store(store_uri), publisher_id="bench")
    views = work / "views"
    for version in (0, 1, 2):
        (views / str(version)).mkdir(parents=True)
        (views / str(version) / "config.json").write_text("{}")
    weights = "model.safetensors"
    size = write_view(views / "0" / weights, args.fanout_mb / 1000, min(args.tensor_mb, args.fanout_mb))
    shutil.copyfile(views / "0" / weights, views / "1" / weights)
    write_target(views / "0" / weights, views / "1" / weights, 0.3, seed=1)  # v1: a new anchor (another view)
    write_target(views / "1" / weights, views / "2" / weights, 0.004, seed=2)  # v2: 0.4% changed
    channel.publish({"bf16": views / "0"}, version=0)
    pool = ProcessPoolExecutor(args.subscribers)
    subs = work / "subs"
    try:
        list(pool.map(functools.partial(_subscriber, store_uri, 0, None, str(subs)), range(args.subscribers)))
        out: dict[str, Any] = {"view_bytes": size, "subscribers": args.subscribers}
        for version, kind in ((1, "full"), (2, "delta")):
            start = time.time()
            if kind == "delta":
                payload = work / "model.safetensors.delta"
                assert encode_delta(views / "1" / weights, views / "2" / weights, payload) is not None
                result = channel.publish(
                    {"bf16": views / "2"}, version=2, deltas={"bf16": DeltaSource(1, {weights: payload})}
                )
            else:
                result = channel.publish({"bf16": views / "1"}, version=1)
            published = time.time()
            done = list(
                pool.map(
                    functools.partial(_subscriber, store_uri, version, version - 1, str(subs)),
                    range(args.subscribers),
                )
            )
            last = max(t for t, _ in done)
            read = [sum(r.values()) for _, r in done]
            out[kind] = {
                "publish_s": published - start,
                "fanout_s": last - published,
                "total_s": last - start,
                "stored_bytes": result.bytes,
                "read_bytes_per_subscriber": statistics.mean(read),
            }
            print(
                f"{kind:5s} v{version}: stored {result.bytes / 1e6:8.2f} MB ({result.bytes / size:.2%} of the view); "
                f"publish {published - start:6.2f}s, then all {args.subscribers} subscribers hold it verified "
                f"{last - published:6.2f}s later ({last - start:6.2f}s from the publish's start); "
                f"each read {statistics.mean(read) / 1e6:.2f} MB",
                flush=True,
            )
        f, d = out["full"], out["delta"]
        print(
            f"delta / full: bytes read {d['read_bytes_per_subscriber'] / f['read_bytes_per_subscriber']:.3f}x, "
            f"publish {d['publish_s'] / f['publish_s']:.2f}x, fan-out {d['fanout_s'] / f['fanout_s']:.2f}x, "
            f"publish to every subscriber {d['total_s'] / f['total_s']:.2f}x",
            flush=True,
        )
        return out
    finally:
        pool.shutdown()


def shards(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A view of `--shards` files (`--gb` in all) in a filesystem store (or --s3), v0 an anchor and v1 a
    delta of each shard at the first `--rates`; a subscriber holding v0 obtains v1 (apply + verify of every
    shard) and a fresh one obtains v0 (download + verify), with 1 and with `--workers` files at once."""
    from rlfleet.channel import DeltaSource, WeightChannel
    from rlfleet.store import open_store

    store_uri = args.store_uri or str(work / "store")
    if not args.store_uri:
        (work / "store").mkdir(parents=True)
    v0, v1 = work / "v0", work / "v1"
    v0.mkdir(parents=True)
    v1.mkdir()
    payloads = {}
    for i in range(args.shards):
        name = f"model-{i + 1:05d}-of-{args.shards:05d}.safetensors"
        write_view(
            v0 / name, args.gb / args.shards, min(args.tensor_mb, int(args.gb / args.shards * 1000)), seed=i
        )
        write_target(v0 / name, v1 / name, args.rates[0], seed=100 + i)
        payloads[name] = work / "payloads" / (name + ".delta")
        payloads[name].parent.mkdir(exist_ok=True)
        assert encode_delta(v0 / name, v1 / name, payloads[name]) is not None
    size = sum(p.stat().st_size for p in v0.iterdir())
    publisher = WeightChannel(open_store(store_uri), publisher_id="bench")
    publisher.publish({"bf16": v0}, version=0)
    publisher.publish({"bf16": v1}, version=1, deltas={"bf16": DeltaSource(0, payloads)})
    held = WeightChannel(open_store(store_uri)).obtain_view(0, "bf16", work / "held").directory
    ops: dict[str, Callable[[], object]] = {}
    for workers in (1, args.workers):
        reader = WeightChannel(open_store(store_uri), download_workers=workers)
        ops[f"download_verify_{workers}"] = functools.partial(
            reader.obtain_view, 0, "bf16", work / f"full-{workers}"
        )
        ops[f"apply_verify_{workers}"] = functools.partial(
            reader.obtain_view, 1, "bf16", work / f"delta-{workers}", local={0: held}
        )
    t = round_robin(ops, args.reps)
    out = {
        "view_bytes": size,
        "shards": args.shards,
        "workers": args.workers,
        "rate": args.rates[0],
        **{k: size / GB / v for k, v in t.items()},
    }
    w = args.workers
    print(
        f"{args.shards} shards, {size / GB:.2f} GB, {args.rates[0]:.1%} changed: GB/s of full view with 1 / {w} "
        f"files at once: download+verify {out['download_verify_1']:.2f} / {out[f'download_verify_{w}']:.2f}, "
        f"apply+verify {out['apply_verify_1']:.2f} / {out[f'apply_verify_{w}']:.2f} "
        f"(apply+verify / download+verify: {t['apply_verify_1'] / t['download_verify_1']:.2f}x / "
        f"{t[f'apply_verify_{w}'] / t[f'download_verify_{w}']:.2f}x)",
        flush=True,
    )
    return out


# ------------------------------------------------------------------------------------------------ a run


def training_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlfleet.channel import WeightChannel
    from rlfleet.store import FilesystemStore
    from rlfleet.tiny_qwen3 import TinyQwen3, build_tiny_qwen3
    from rlfleet.trainer.publish.publisher import WeightPublisher

    torch.set_num_threads(1)
    spec = TinyQwen3(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers
    )
    model_dir = build_tiny_qwen3(work / "model", spec)
    out: dict[str, Any] = {}
    for lr in args.lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        store = FilesystemStore(work / f"store-{lr:g}", create=True)
        publisher = WeightPublisher(
            store,
            views=["bf16", "fp8", "nvfp4"],
            keep_versions=None,
            base_checkpoint=model_dir,
            follow_subscribers=False,
            anchor_every=16,
            max_delta_share=0.5,
        )
        encode: dict[str, float] = {}
        try:
            for step in range(args.steps + 1):
                publisher.publish(model.state_dict(), version=step)
                for v in publisher.last_published.values():
                    encode[v.view] = encode.get(v.view, 0.0) + v.encode_seconds
                tokens = torch.randint(
                    3, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(step)
                )
                loss = model(input_ids=tokens, labels=tokens).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        finally:
            publisher.close()
        channel = WeightChannel(store, publisher_id="bench-reader")
        per_view: dict[str, Any] = {}
        for version in channel.versions():
            for view, vm in channel.manifest(version).views.items():
                v = per_view.setdefault(
                    view, {"shares": [], "weight_shares": [], "anchors": 0, "full_bytes": vm.bytes}
                )
                if vm.delta is None:
                    v["anchors"] += 1
                else:
                    v["shares"].append(vm.stored_bytes / vm.bytes)
                    rebuilt = sum(vm.files[rel].bytes for rel in vm.delta.rebuilt())
                    v["weight_shares"].append(vm.delta.bytes / rebuilt)
        for view, v in sorted(per_view.items()):
            shares, weight_shares = v.pop("shares"), v.pop("weight_shares")
            v.update(
                deltas=len(shares),
                mean=statistics.mean(shares) if shares else None,
                worst=max(shares, default=None),
                weights_mean=statistics.mean(weight_shares) if shares else None,
                weights_worst=max(weight_shares, default=None),
                encode_s_per_gb=encode[view] / (v["full_bytes"] * (args.steps + 1) / GB),
            )
            print(
                f"lr {lr:g} {view:5s}: view {v['full_bytes'] / 1e6:6.2f} MB, {v['anchors']} anchors + {v['deltas']} deltas; "
                + (
                    f"a delta stores {v['mean']:.2%} of the view on average, worst {v['worst']:.2%} (of the safetensors "
                    f"files alone {v['weights_mean']:.2%}, worst {v['weights_worst']:.2%})"
                    if shares
                    else "no delta"
                )
                + f"; encode {v['encode_s_per_gb']:.2f} s per GB of view",
                flush=True,
            )
        out[f"{lr:g}"] = per_view
    return out


# -------------------------------------------------------------------------------------- scaled to a fleet

FLEET = {  # view: (replicas, GB of the complete view, share of elements changed per version at lr 1e-6, bytes per element)
    "bf16": (8, 61.0, 0.0040, 2),
    "fp8": (4, 41.0, 0.0006, 1),
    "nvfp4": (4, 32.0, 0.0003, 1),
}
ANCHOR_EVERY = 16


def gap_bytes(changed: float) -> float:
    """Expected gap bytes per changed element (rlfleet/deltas.py, v2) when a share `changed` of the elements
    changes at random places: the gaps are geometric, P(g > 255 j) = q^j with q = (1 - changed)^255, and a
    gap costs 1 + floor((g - 1) / 255) bytes: 1 + q / (1 - q)."""
    q = (1 - changed) ** 255
    return 1 + q / (1 - q)


def scaled(results: dict[str, Any], link_gbps: float) -> list[dict[str, Any]]:
    """Per view and for the fleet: GB read per version (full; a delta; the mean with an anchor every
    ANCHOR_EVERY) and seconds until a replica holds the verified version: full = the slower of the link
    and the measured download + verify from a store on the replica's own disk (the bytes land there and
    are hashed as they land); delta = download of the delta over the link + apply + verify at the
    measured rate (GB/s of full view, of the measured change rate nearest the view's byte share)."""
    codec_rows = results["codec"]
    link = link_gbps / 8  # GB/s
    rows = []
    for view, (replicas, gb, changed, width) in FLEET.items():
        share = changed * (gap_bytes(changed) + width) / width
        row = min(codec_rows, key=lambda r: abs(r["delta_share"] - share))
        full_s = max(gb / link, gb / row["download_verify_gbps"])
        delta_s = gb * share / link + gb / row["apply_verify_gbps"]
        rows.append(
            {
                "view": view,
                "replicas": replicas,
                "view_gb": gb,
                "delta_share": share,
                "full_gb": replicas * gb,
                "delta_gb": replicas * gb * share,
                "mean_gb": replicas * gb * (1 / ANCHOR_EVERY + (1 - 1 / ANCHOR_EVERY) * share),
                "full_s": full_s,
                "delta_s": delta_s,
                "apply_rate_from": row["rate"],
            }
        )
    return rows


def print_scaled(rows: list[dict[str, Any]], link_gbps: float, store_gbps: float) -> None:
    print(
        f"Qwen3-30B-A3B-sized fleet, 8 groups x 2 replicas, {link_gbps:g} Gb/s per replica, the store serving "
        f"{store_gbps:g} Gb/s in all:"
    )
    print(
        "| view | replicas | view GB | delta share | GB read per version: full | delta | mean, anchor every 16 "
        "| s per version per replica: full | delta |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['view']} | {r['replicas']} | {r['view_gb']:.0f} | {r['delta_share']:.2%} | {r['full_gb']:.0f} | "
            f"{r['delta_gb']:.2f} | {r['mean_gb']:.1f} | {r['full_s']:.0f} | {r['delta_s']:.0f} |"
        )
    total = {k: sum(r[k] for r in rows) for k in ("full_gb", "delta_gb", "mean_gb")}
    # every replica at once: the slowest replica, or the store's total egress when it is the narrower pipe
    full_s = max(max(r["full_s"] for r in rows), total["full_gb"] / (store_gbps / 8))
    delta_s = max(max(r["delta_s"] for r in rows), total["delta_gb"] / (store_gbps / 8))
    print(
        f"| fleet | {sum(r['replicas'] for r in rows)} | | | {total['full_gb']:.0f} | {total['delta_gb']:.2f} | "
        f"{total['mean_gb']:.1f} | {full_s:.0f} | {delta_s:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gb", type=float, default=1.07, help="size of the synthetic bf16 view (GB)")
    parser.add_argument("--tensor-mb", type=int, default=128, help="size of each tensor (MiB)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.004, 0.02, 0.58])
    parser.add_argument("--reps", type=int, default=3, help="runs per timing (the median is shown)")
    parser.add_argument(
        "--only", choices=["codec", "shards", "fanout", "run"], default=None, help="one part (default: all)"
    )
    parser.add_argument("--shards", type=int, default=4, help="files of the shards' view (shards)")
    parser.add_argument("--workers", type=int, default=4, help="files obtained at once against 1 (shards)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per learning rate (run)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 5e-4])
    parser.add_argument("--hidden", type=int, default=512, help="the run's tiny Qwen3 hidden size")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--subscribers", type=int, default=16)
    parser.add_argument("--fanout-mb", type=int, default=128, help="size of the fan-out's view (MB)")
    parser.add_argument("--s3", action="store_true", help="fan-out from a moto_server S3 store")
    parser.add_argument(
        "--scale-from", type=Path, default=None, help="print the fleet table from a run's --json"
    )
    parser.add_argument("--link-gbps", type=float, nargs="+", default=[10.0, 100.0])
    parser.add_argument(
        "--store-gbps", type=float, default=100.0, help="the store's egress to all replicas (Gb/s)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.scale_from:
        for link in args.link_gbps:
            print_scaled(scaled(json.loads(args.scale_from.read_text()), link), link, args.store_gbps)
        return 0
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlfleet-deltas-", dir=args.dir) as tmp:
        if args.only in (None, "codec"):
            with s3_store(args) as uri:
                args.store_uri = uri
                results["codec"] = codec(args, Path(tmp) / "codec")
        if args.only in (None, "shards"):
            with s3_store(args) as uri:
                args.store_uri = uri
                results["shards"] = shards(args, Path(tmp) / "shards")
        if args.only in (None, "fanout"):
            with s3_store(args) as uri:
                args.store_uri = uri
                results["fanout"] = fanout(args, Path(tmp) / "fanout")
        if args.only in (None, "run"):
            results["run"] = training_run(args, Path(tmp) / "run")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


@contextlib.contextmanager
def s3_store(args: argparse.Namespace) -> Iterator[str | None]:
    """With --s3: a bucket on a moto_server process (real HTTP), as tests/weights/conftest.py starts it."""
    if not args.s3:
        yield None
        return
    import socket
    import subprocess

    import boto3
    import httpx

    creds = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    os.environ.update(creds)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1.0)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        yield f"s3://bench/weights?endpoint={endpoint}"
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())
