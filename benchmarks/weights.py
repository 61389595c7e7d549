"""Benchmark of the weight channel. Prints RATIOS against baselines run in the same process.

1. bytes per view relative to bf16 (from the published manifest);
2. publish throughput (WeightChannel.publish of the already-converted view files: hashing, durable
   writes, manifest, pointer) relative to a plain copy of the same bytes to the same filesystem,
   with and without fsync; the publisher's own path from converted tensors (each file hashed with
   BLAKE3 in the pass that writes it, then fsync + rename + manifest + pointer) relative to a plain
   page-cache copy of the same bytes, with a sha256 row of the same path for comparison; the same
   against a real S3-compatible server (moto_server process) relative to plain boto3 `upload_file`
   of the same files;
3. apply latency: the sidecar's reconcile step (download + verify every BLAKE3 digest + engine apply via
   `POST /update_weights_from_disk`) on the reference sampler server (`rlfleet sampler serve
   --engine reference`, started as a subprocess, serving the project's tiny Qwen3 at the same sizes)
   relative to loading the same view in-process with `load_view` (the floor any apply pays);
4. deltas between consecutive versions (optional feature): share of bf16 elements that change after
   one Adam step, and the zlib size of an XOR delta relative to the full bf16 view.

    .venv/bin/python -P benchmarks/weights.py                       # ~64M parameters (128 MB bf16)
    .venv/bin/python -P benchmarks/weights.py --layers 1 --reps 2   # quick
    .venv/bin/python -P benchmarks/weights.py --only write-publish  # just the publisher-path rows
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3
import torch

from rlfleet.channel import WeightChannel
from rlfleet.numerics.views import (
    VIEWS,
    load_view,
    safetensors_chunks,
    save_view,
    view_tensors,
    write_safetensors,
)
from rlfleet.store import FileDigest, FilesystemStore, S3Store, write_file_hashed


def synthetic_state(layers: int, d_model: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named decoder weights (fp32 master copy), std 0.02 like a trained LLM's projections."""
    g = torch.Generator().manual_seed(seed)
    ffn = 4 * d_model
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, d_model, generator=g) * 0.02
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q", "k", "v", "o"):
            sd[f"{p}.self_attn.{name}_proj.weight"] = torch.randn(d_model, d_model, generator=g) * 0.02
        sd[f"{p}.mlp.gate_proj.weight"] = torch.randn(ffn, d_model, generator=g) * 0.02
        sd[f"{p}.mlp.up_proj.weight"] = torch.randn(ffn, d_model, generator=g) * 0.02
        sd[f"{p}.mlp.down_proj.weight"] = torch.randn(d_model, ffn, generator=g) * 0.02
        sd[f"{p}.input_layernorm.weight"] = torch.ones(d_model)
        sd[f"{p}.post_attention_layernorm.weight"] = torch.ones(d_model)
    sd["model.norm.weight"] = torch.ones(d_model)
    sd["lm_head.weight"] = torch.randn(vocab, d_model, generator=g) * 0.02
    return sd


def copy_tree(src: Path, dst: Path, fsync: bool) -> None:
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        if fsync:
            fd = os.open(target, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    if fsync:
        for d in sorted({p.parent for p in dst.rglob("*")} | {dst}):
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(fd)
            os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_filesystem(view_dirs: dict[str, Path], total: int, work: Path, reps: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {"copy": [], "copy_fsync": [], "publish": [], "publish_move": []}
    store = FilesystemStore(work / "store", create=True)
    channel = WeightChannel(store)
    for rep in range(reps):  # interleaved: every rep sees the same machine state for all cases
        t0 = time.perf_counter()
        for v, d in view_dirs.items():
            copy_tree(d, work / f"cp{rep}" / v, False)
        t1 = time.perf_counter()
        for v, d in view_dirs.items():
            copy_tree(d, work / f"cpf{rep}" / v, True)
        t2 = time.perf_counter()
        channel.publish(view_dirs)
        t3 = time.perf_counter()
        runs["copy"].append(t1 - t0)
        runs["copy_fsync"].append(t2 - t1)
        runs["publish"].append(t3 - t2)
        # The publisher's own path: views staged on the store's filesystem, renamed into place.
        staging = store.staging_dir()
        assert staging is not None
        staged = {v: staging / f"rep{rep}" / v for v in view_dirs}
        for v, d in view_dirs.items():
            shutil.copytree(d, staged[v])
        os.sync()  # staged bytes start clean on disk, as right after save_view
        t4 = time.perf_counter()
        channel.publish(staged, move=True)
        runs["publish_move"].append(time.perf_counter() - t4)
        channel.retain(keep=1)
        shutil.rmtree(work / f"cp{rep}")
        shutil.rmtree(work / f"cpf{rep}")
        shutil.rmtree(staging / f"rep{rep}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "publish_copy_MBps": total / med["publish"] / 1e6,
        "publish_move_MBps": total / med["publish_move"] / 1e6,
        "plain_copy_MBps": total / med["copy"] / 1e6,
        "plain_copy_fsync_MBps": total / med["copy_fsync"] / 1e6,
        "publish_copy_vs_plain_copy": med["copy"] / med["publish"],
        "publish_copy_vs_plain_copy_fsync": med["copy_fsync"] / med["publish"],
        "publish_move_vs_plain_copy": med["copy"] / med["publish_move"],
        "publish_move_vs_plain_copy_fsync": med["copy_fsync"] / med["publish_move"],
    }


def _publish_path(
    store: FilesystemStore,
    rep: int,
    algorithm: str,
    view_dirs: dict[str, Path],
    tensors: dict[str, dict[str, torch.Tensor]],
) -> None:
    """The publisher's path once: write and hash every view in parallel, then publish by moving."""
    staging = store.staging_dir()
    assert staging is not None
    staged = {v: staging / f"rep{rep}-{algorithm}" / v for v in view_dirs}

    def write(v: str) -> FileDigest:  # views in parallel, as WeightPublisher.publish does
        staged[v].mkdir(parents=True)
        path = staged[v] / "model.safetensors"
        if algorithm == "blake3":  # the production function, exactly
            return write_safetensors(tensors[v], path, {"format": "pt"})
        return write_file_hashed(path, safetensors_chunks(tensors[v], {"format": "pt"}), algorithm)

    with ThreadPoolExecutor(max_workers=min(len(staged), os.cpu_count() or 1)) as pool:
        digests = dict(
            zip((d / "model.safetensors" for d in staged.values()), pool.map(write, staged), strict=True)
        )
    WeightChannel(store).publish(staged, move=True, digests=digests)
    shutil.rmtree(staging / f"rep{rep}-{algorithm}")  # the emptied staging directories


def _one_core_rates(work: Path) -> tuple[int, dict[str, float]]:
    """One core's seconds per 64 MiB buffer (median of 5) to write, hash, and write while hashing:
    what each byte of the publisher path costs, measured in the same run."""
    blob = os.urandom(64 * 1024 * 1024)
    probe = work / "write-probe"

    def write_blob() -> None:
        with open(probe, "wb", buffering=0) as f:
            f.write(blob)

    def hashed_write(algorithm: str) -> Callable[[], object]:
        return lambda: write_file_hashed(probe, [blob], algorithm)

    one_core: dict[str, float] = {}
    for name, fn in {
        "write": write_blob,
        "blake3": lambda: blake3.blake3(blob).digest(),
        "sha256": lambda: hashlib.sha256(blob).digest(),
        "write_hashed_blake3": hashed_write("blake3"),
        "write_hashed_sha256": hashed_write("sha256"),
    }.items():
        samples = []
        for _ in range(5):
            with contextlib.suppress(FileNotFoundError):
                probe.unlink()
            os.sync()
            samples.append(timed(fn))
        one_core[name] = statistics.median(samples)
    probe.unlink()
    return len(blob), one_core


def _hash_overlap(one_core: dict[str, float], copy_rate: float, blob_len: int) -> dict[str, float]:
    """How far the hash thread overlapped write(2), per algorithm, and the cores that would take."""
    out: dict[str, float] = {}
    for algorithm in ("blake3", "sha256"):
        # Overlap check: 1.0 = the hash thread ran while write(2) did (cost = the slower of the two);
        # (write + hash) / max(write, hash) = no overlap (the GIL or the handoff serialised them).
        serial = one_core["write"] + one_core[algorithm]
        slower = max(one_core["write"], one_core[algorithm])
        out[f"one_file_{algorithm}_hashed_write_vs_max_write_hash"] = (
            one_core[f"write_hashed_{algorithm}"] / slower
        )
        out[f"one_file_{algorithm}_serial_would_be_vs_max"] = serial / slower
        # Matching 0.8 x a single-threaded page-cache copy needs this many free cores.
        out[f"cores_for_0.8x_plain_copy_{algorithm}"] = 0.8 * copy_rate * serial / blob_len
    return out


def bench_write_publish(
    state: dict[str, torch.Tensor], view_dirs: dict[str, Path], total: int, work: Path, reps: int
) -> dict[str, float]:
    """The publisher's whole path from converted tensors: every view file written with its BLAKE3
    digest computed in the SAME pass (`write_safetensors` -> `write_file_hashed`: a second thread
    hashes chunk i while chunk i is written), then `WeightChannel.publish(move=True, digests=...)`
    (fsync, rename, manifest, pointer; no second read to hash). The same path with sha256 (what the
    manifest carried before) is a row of the same run. Baselines, interleaved per rep: a plain
    page-cache copy of the same bytes (copyfile, no fsync), the same + fsync, and safetensors' own
    `save_file` of the same tensors (no hash)."""
    from safetensors.torch import save_file

    tensors = {v: view_tensors(state, v)[0] for v in view_dirs}
    runs: dict[str, list[float]] = {
        "copy": [],
        "copy_fsync": [],
        "plain_write": [],
        "publisher": [],
        "publisher_page_cache": [],
        "publisher_page_cache_sha256": [],
    }
    durable = FilesystemStore(work / "wp-store", create=True)
    volatile = FilesystemStore(work / "wp-store-nofsync", create=True, fsync=False)

    def plain_write(rep: int) -> None:
        (work / f"wpw{rep}").mkdir()
        for v in view_dirs:
            save_file(tensors[v], str(work / f"wpw{rep}" / f"{v}.safetensors"), metadata={"format": "pt"})

    cases = {
        "copy": lambda rep: [copy_tree(d, work / f"wcp{rep}" / v, False) for v, d in view_dirs.items()],
        "copy_fsync": lambda rep: [copy_tree(d, work / f"wcpf{rep}" / v, True) for v, d in view_dirs.items()],
        "plain_write": plain_write,
        "publisher": lambda rep: _publish_path(durable, rep, "blake3", view_dirs, tensors),
        "publisher_page_cache": lambda rep: _publish_path(volatile, rep, "blake3", view_dirs, tensors),
        "publisher_page_cache_sha256": lambda rep: _publish_path(volatile, rep, "sha256", view_dirs, tensors),
    }
    cpu: dict[str, list[float]] = {k: [] for k in runs}  # this process's CPU seconds (all threads)
    for rep in range(reps):  # interleaved; each case starts with no dirty pages (no writeback throttling)
        for key, case in cases.items():
            os.sync()
            c0, t0 = time.process_time(), time.perf_counter()
            case(rep)
            runs[key].append(time.perf_counter() - t0)
            cpu[key].append(time.process_time() - c0)
            for store in (durable, volatile):
                WeightChannel(store).retain(keep=1)
        for d in (f"wcp{rep}", f"wcpf{rep}", f"wpw{rep}"):
            shutil.rmtree(work / d)
    med = {k: statistics.median(v) for k, v in runs.items()}
    blob_len, one_core = _one_core_rates(work)
    copy_rate = total / med["copy"]
    out = {
        **{f"{k}_MBps": total / t / 1e6 for k, t in med.items()},
        # cores the case kept busy (CPU seconds / wall seconds): the copy is one kernel thread, the
        # publisher two threads per file (write + hash), so it needs a second free core to keep up
        **{f"{k}_cores_used": statistics.median(cpu[k]) / med[k] for k in ("copy", "publisher_page_cache")},
        "publisher_vs_plain_copy": med["copy"] / med["publisher"],
        "publisher_vs_plain_copy_fsync": med["copy_fsync"] / med["publisher"],
        "publisher_page_cache_vs_plain_copy": med["copy"] / med["publisher_page_cache"],
        "publisher_page_cache_sha256_vs_plain_copy": med["copy"] / med["publisher_page_cache_sha256"],
        "publisher_page_cache_vs_plain_write": med["plain_write"] / med["publisher_page_cache"],
        **{f"one_core_{k}_MBps": blob_len / t / 1e6 for k, t in one_core.items()},
    }
    out.update(_hash_overlap(one_core, copy_rate, blob_len))
    return out


def bench_s3(view_dirs: dict[str, Path], total: int, reps: int) -> dict[str, float]:
    import boto3

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "weights"))
    from conftest import CREDS, free_port, start_moto  # the same real server the tests use

    os.environ.update({k: os.environ.get(k, v) for k, v in CREDS.items()})
    port = free_port()
    proc = start_moto(port)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        store = S3Store("bench", "channel", endpoint_url=endpoint)
        channel = WeightChannel(store, upload_workers=2)
        files = [(v, p) for v, d in view_dirs.items() for p in sorted(d.rglob("*")) if p.is_file()]
        plain, publish = [], []
        for rep in range(reps):
            t0 = time.perf_counter()
            for v, p in files:
                client.upload_file(str(p), "bench", f"plain{rep}/{v}/{p.name}")
            t1 = time.perf_counter()
            channel.publish(view_dirs)
            plain.append(t1 - t0)
            publish.append(time.perf_counter() - t1)
            channel.retain(keep=1)
            client.delete_objects(
                Bucket="bench", Delete={"Objects": [{"Key": f"plain{rep}/{v}/{p.name}"} for v, p in files]}
            )
        med_plain, med_pub = statistics.median(plain), statistics.median(publish)
        return {
            "publish_MBps": total / med_pub / 1e6,
            "upload_MBps": total / med_plain / 1e6,
            "ratio_vs_upload": med_plain / med_pub,
        }
    finally:
        proc.terminate()
        proc.wait(10)


def start_reference_server(work: Path, checkpoint: Path, weight_format: str) -> tuple[subprocess.Popen, str]:
    """`rlfleet sampler serve --engine reference` (the sampler engineer's server) on a free port."""
    port_file = work / f"server-{weight_format}.port"
    log = work / f"server-{weight_format}.log"
    cmd = [
        sys.executable,
        "-m",
        "rlfleet.cli",
        "sampler",
        "serve",
        "--engine",
        "reference",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--model-path",
        str(checkpoint),
        "--weight-format",
        weight_format,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reference server exited: {log.read_text()[-2000:]}")
        if port_file.exists() and port_file.read_text().strip():
            return proc, f"http://127.0.0.1:{int(port_file.read_text())}"
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("reference server did not start")


def bench_apply(
    layers: int, d_model: int, vocab: int, views: list[str], work: Path, reps: int
) -> dict[str, dict[str, float]]:
    """Per view: a reference server of that weight format, `reps` versions applied by the sidecar.
    The reference engine serves Qwen3 checkpoints, so the model here is the project's tiny Qwen3
    (rlfleet/tiny_qwen3.py) at the benchmark's sizes (head_dim 64), published as HF views of its
    checkpoint (nvfp4 with calibrated activation amax)."""
    import httpx

    from rlfleet.numerics.views import calibrate_activation_amax
    from rlfleet.sampler.engine_clients import DiskEngine
    from rlfleet.sampler.sync_state import SyncConfig
    from rlfleet.sampler.syncer import Syncer
    from rlfleet.tiny_qwen3 import TinyQwen3, build_tiny_qwen3, tiny_model
    from rlfleet.trainer.publish.publisher import WeightPublisher

    heads = max(1, d_model // 64)
    spec = TinyQwen3(
        vocab_size=vocab,
        hidden_size=d_model,
        intermediate_size=4 * d_model,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=64,
    )
    checkpoint = build_tiny_qwen3(work / "qwen3-base", spec)
    model = tiny_model(spec)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amax = calibrate_activation_amax(model, [torch.arange(32).reshape(2, 16)])
    store = FilesystemStore(work / "apply-store", create=True)
    results: dict[str, dict[str, float]] = {}

    async def apply_once(url: str, view: str, version: int) -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            config = SyncConfig(
                store="",
                view=view,
                engine_url=url,
                group="bench",
                replica="r0",
                cache_dir=work / "cache" / view,
            )
            syncer = Syncer(config, store, DiskEngine(client))
            syncer.state.applied_version = version - 1
            ok = await syncer.reconcile_once()
            assert ok, syncer.state.last_error
            last = syncer.state.last_apply
            assert last is not None
            return last.download_seconds, last.apply_seconds

    for view in views:
        proc, url = start_reference_server(work, checkpoint, view)
        runs: dict[str, list[float]] = {"direct": [], "download": [], "apply": []}
        try:
            publisher = WeightPublisher(
                store, views=[view], follow_subscribers=False, keep_versions=2, base_checkpoint=checkpoint
            )
            for _ in range(reps):
                # the pointer names the version to apply
                version = publisher.publish(state, activation_amax=amax).version
                d, a = asyncio.run(apply_once(url, view, version))
                runs["download"].append(d)
                runs["apply"].append(a)
                t0 = time.perf_counter()
                load_view(work / "cache" / view / f"v{version}-{view}")
                runs["direct"].append(time.perf_counter() - t0)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        med = {k: statistics.median(v) for k, v in runs.items()}
        results[view] = {
            "download_verify_s": med["download"],
            "engine_apply_s": med["apply"],
            "total_s": med["download"] + med["apply"],
            "load_view_s": med["direct"],
            "apply_vs_load_view": med["apply"] / med["direct"],
            "total_vs_load_view": (med["download"] + med["apply"]) / med["direct"],
        }
    return results


def bench_delta(state: dict[str, torch.Tensor], lrs: list[float]) -> dict[str, dict[str, float]]:
    """One Adam step on the master weights (random gradient; Adam's first step moves every element by
    ~lr), then how much of the bf16 view changes and how well an XOR delta compresses, vs the full view."""
    names = [n for n in state if n.endswith("_proj.weight")]
    before = torch.cat([state[n].to(torch.bfloat16).view(torch.int16).flatten() for n in names])
    full = before.numpy().tobytes()
    t0 = time.perf_counter()
    full_z = zlib.compress(full, 1)
    t_full = time.perf_counter() - t0
    out = {}
    for lr in lrs:
        params = [torch.nn.Parameter(state[n].clone()) for n in names]
        opt = torch.optim.Adam(params, lr=lr)
        g = torch.Generator().manual_seed(1)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        after = torch.cat([p.detach().to(torch.bfloat16).view(torch.int16).flatten() for p in params])
        changed = (after != before).float().mean().item()
        xor = (after ^ before).numpy().tobytes()
        t0 = time.perf_counter()
        delta_z = zlib.compress(xor, 1)
        t_delta = time.perf_counter() - t0
        out[f"lr={lr:g}"] = {
            "changed_share": changed,
            "delta_zlib_vs_full": len(delta_z) / len(full),
            "full_zlib_vs_full": len(full_z) / len(full),
            "compress_MBps": len(xor) / t_delta / 1e6,
        }
    out["_full_compress_MBps"] = {"value": len(full) / t_full / 1e6}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--no-apply", action="store_true")
    parser.add_argument(
        "--only",
        choices=["write-publish"],
        default=None,
        help="run only these rows (write-publish: the publisher path)",
    )
    parser.add_argument(
        "--workdir", default=None, help="directory on the filesystem to measure (default: a temp dir)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the reference server (--threads 1); a 2-thread pool spins on a loaded box

    state = synthetic_state(args.layers, args.d_model, args.vocab)
    params = sum(t.numel() for t in state.values())
    report: dict[str, object] = {
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "params": params,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="rlfleet-bench-") as tmp:
        work = Path(tmp)
        view_dirs: dict[str, Path] = {}
        convert: dict[str, float] = {}
        for view in VIEWS:
            view_dirs[view] = work / "views" / view
            convert[view] = timed(lambda v=view: save_view(state, v, view_dirs[v]))
        sizes = {v: sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) for v, d in view_dirs.items()}
        total = sum(sizes.values())
        report["bytes_per_view_vs_bf16"] = {v: round(sizes[v] / sizes["bf16"], 4) for v in VIEWS}
        report["bytes_bf16_MB"] = round(sizes["bf16"] / 1e6, 1)
        report["convert_s_vs_bf16"] = {v: round(convert[v] / convert["bf16"], 2) for v in VIEWS}
        report["convert_s"] = {v: round(convert[v], 3) for v in VIEWS}
        every_row = args.only is None
        if every_row:
            report["publish_filesystem"] = {
                k: round(v, 3) for k, v in bench_filesystem(view_dirs, total, work, args.reps).items()
            }
        report["write_and_publish_filesystem"] = {
            k: round(v, 3) for k, v in bench_write_publish(state, view_dirs, total, work, args.reps).items()
        }
        if every_row and not args.no_s3:
            report["publish_s3_moto"] = {
                k: round(v, 3) for k, v in bench_s3(view_dirs, total, args.reps).items()
            }
        if every_row and not args.no_apply:
            report["apply_reference_server"] = {
                v: {k: round(x, 4) for k, x in r.items()}
                for v, r in bench_apply(
                    args.layers, args.d_model, args.vocab, ["bf16", "fp8", "nvfp4"], work, args.reps
                ).items()
            }
        if every_row:
            report["delta"] = {
                k: {m: round(x, 4) for m, x in r.items()}
                for k, r in bench_delta(state, [1e-6, 1e-5, 1e-4]).items()
            }
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
