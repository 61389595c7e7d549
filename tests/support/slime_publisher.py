"""A stand-in for slime's trainer side of disk weight publishing (`--update-weight-transport disk`).

slime (THUDM/slime) cannot be installed here: it is not on PyPI, GitHub is unreachable from the test
machines, and its publish path needs megatron, ray and torch.distributed. This writes `weight_v{N:06d}/`
exactly as slime's code at commit 624b824a (2026-08-21) does, transcribed from it as read:

- full, slime/backends/megatron_utils/update_weight/update_weight_from_disk.py `update_weights` and
  ../hf_checkpoint_saver.py `save_hf_model_to_path`: the version dir emptied and made, the base's
  non-weight files copied (`_copy_hf_assets`), each chunk saved with `safetensors.torch.save_file(...,
  metadata={"format": "pt"})` as `model-{chunk+1:05d}.safetensors`, renamed to
  `model-{i:05d}-of-{n:05d}.safetensors` (i from 1), then `model.safetensors.index.json`
  (`{"metadata": {"total_size": bytes}, "weight_map": ...}`, json.dump indent=2) written last;
- delta, update_weight_from_disk_delta.py `_encode_delta` + `_write_delta_files` with
  slime/utils/disk_delta.py `overwrite_encode` / `checksum`: each tensor's bytes diffed against the
  snapshot (the previous version; the first against the hf_checkpoint's bytes), `xor` (new ^ old) or
  `overwrite` (u4 count, u4 positions, new bytes), unchanged tensors left out, each diff
  `zstandard.ZstdCompressor(level=1).compress`-ed into a uint8 array; one file per writing rank that has
  a changed tensor, numbered `model-{offset:05d}-of-{total:05d}.safetensors` with offset from 0 over the
  ranks that write (no gaps), `safetensors.numpy.save(delta, metadata=checksums)` (new-state hexdigest
  per tensor) written atomically (`.tmp` + os.replace); then the index, last, by rank 0:
  `{"metadata": {"version": "%06d", "base_version": "%06d", "delta_encoding", "compression_format":
  "zstd", "checksum_format"}, "weight_map": ...}` (json.dumps).

One slime run uses one mode; the stand-in may mix them within one stream (the receive side, SGLang's
/pull_weights, handles a mixed stream: the newest full version, then deltas), which the tests use to
cover both with one bridge.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
import zstandard
from safetensors.torch import load_file, save_file

INDEX = "model.safetensors.index.json"
_WEIGHT_NAMES = {
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "tf_model.h5",
    "flax_model.msgpack",
}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack")


def checksum(algorithm: str, buf: np.ndarray) -> str:
    """slime/utils/disk_delta.py `checksum` (hexdigest of the new bytes)."""
    if algorithm == "xxh3-128":
        import xxhash

        h = xxhash.xxh3_128()
    elif algorithm == "blake3":
        import blake3

        h = blake3.blake3()
    elif algorithm == "adler32":
        return f"{zlib.adler32(buf, 1):08x}"
    else:
        raise KeyError(f"unknown checksum algorithm {algorithm!r}")
    h.update(buf)
    return h.hexdigest()


def overwrite_encode(new: np.ndarray, changed_mask: np.ndarray) -> np.ndarray:
    """slime/utils/disk_delta.py `overwrite_encode`."""
    pos = np.flatnonzero(changed_mask).astype("<u4")
    return np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), new[changed_mask]])


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(torch.uint8).numpy().reshape(-1).copy()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = str(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class SlimeStandIn:
    """slime's trainer publishing to `publish_dir` from `hf_checkpoint` (its --hf-checkpoint).

    `weights[v]`: the weights of version v (0: the hf_checkpoint's). `publish(new, kind=...)` makes the
    next version; `write(v, ...)` (re)writes version v's directory from `weights[v]` against `weights[v-1]`
    (a delta's snapshot is the previous version, as slime's snapshot after each sync)."""

    def __init__(
        self, publish_dir: Path, hf_checkpoint: Path, *, writing_ranks: int = 2, shards: int = 2
    ) -> None:
        self.publish_dir = Path(publish_dir)
        self.hf_checkpoint = Path(hf_checkpoint)
        self.writing_ranks = writing_ranks
        self.shards = shards
        # _capture_baseline: a prior run's versions would apply against the wrong base; start the dir clean
        shutil.rmtree(self.publish_dir, ignore_errors=True)
        self.publish_dir.mkdir(parents=True)
        base: dict[str, torch.Tensor] = {}
        for path in sorted(self.hf_checkpoint.glob("*.safetensors")):
            base.update(load_file(str(path)))
        self.weights: dict[int, dict[str, torch.Tensor]] = {0: base}
        self.version = 0

    def version_dir(self, version: int) -> Path:
        return self.publish_dir / f"weight_v{version:06d}"

    def perturbed(
        self, rng: np.random.Generator, tensors: int = 3, elements: int = 5
    ) -> dict[str, torch.Tensor]:
        """The latest weights with `elements` random elements of `tensors` random tensors changed."""
        new = {k: v.clone() for k, v in self.weights[self.version].items()}
        names = sorted(new)
        for i in rng.choice(len(names), size=tensors, replace=False):
            t = new[names[int(i)]].view(-1)
            idx = torch.from_numpy(rng.choice(t.numel(), size=min(elements, t.numel()), replace=False))
            values = torch.from_numpy(rng.standard_normal(idx.numel()).astype(np.float32) * 0.05)
            t[idx] = values.to(t.dtype)
        return new

    def stage(self, new: Mapping[str, torch.Tensor]) -> int:
        """The next version's weights, recorded, nothing written yet (update_weights: weight_version += 1)."""
        self.version += 1
        self.weights[self.version] = {k: v.detach().clone() for k, v in new.items()}
        return self.version

    def publish(
        self,
        new: Mapping[str, torch.Tensor],
        kind: str = "delta",
        *,
        encoding: str = "xor",
        checksum_format: str = "xxh3-128",
    ) -> Path:
        return self.write(self.stage(new), kind, encoding=encoding, checksum_format=checksum_format)

    def write(
        self, version: int, kind: str = "delta", *, encoding: str = "xor", checksum_format: str = "xxh3-128"
    ) -> Path:
        if kind == "full":
            return self._write_full(version)
        return self._write_delta(version, encoding, checksum_format)

    # ------------------------------------------------------------------------------------------- full
    def _write_full(self, version: int) -> Path:
        path = self.version_dir(version)
        shutil.rmtree(path, ignore_errors=True)  # rank 0: shutil.rmtree(version_dir)
        path.mkdir(parents=True, exist_ok=True)
        for item in self.hf_checkpoint.iterdir():  # _copy_hf_assets
            if item.is_file() and not (item.name in _WEIGHT_NAMES or item.name.endswith(_WEIGHT_SUFFIXES)):
                shutil.copy2(item, path / item.name)
        names = list(self.weights[version])
        chunks = [names[i :: self.shards] for i in range(self.shards)]
        shard_files: list[str] = []
        weight_map: dict[str, str] = {}
        total_size = 0
        for chunk_idx, chunk in enumerate(chunks):  # _SafetensorShardWriter.write
            state = {n: self.weights[version][n].contiguous() for n in chunk}
            if not state:
                continue
            filename = f"model-{chunk_idx + 1:05d}.safetensors"
            save_file(state, str(path / filename), metadata={"format": "pt"})
            shard_files.append(filename)
            total_size += sum(t.numel() * t.element_size() for t in state.values())
            weight_map.update(dict.fromkeys(state, filename))
        # _plan_shard_finalization + _finalize_local_shards: rename, then the index
        rename = {
            old: f"model-{i:05d}-of-{len(shard_files):05d}.safetensors"
            for i, old in enumerate(shard_files, start=1)
        }
        for old, new in rename.items():
            os.replace(path / old, path / new)
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {n: rename[f] for n, f in weight_map.items()},
        }
        with open(path / INDEX, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        return path

    # ------------------------------------------------------------------------------------------ delta
    def _write_delta(self, version: int, encoding: str, checksum_format: str) -> Path:
        path = self.version_dir(version)
        shutil.rmtree(path, ignore_errors=True)  # a rewrite in the tests; slime's version dirs are new
        path.mkdir(parents=True, exist_ok=True)
        old, new = self.weights[version - 1], self.weights[version]
        names = list(new)
        # each PP-source rank diffs its own tensors (its pipeline stage): here, round robin
        per_rank: list[tuple[dict[str, np.ndarray], dict[str, str]]] = []
        for rank in range(self.writing_ranks):
            delta: dict[str, np.ndarray] = {}
            sums: dict[str, str] = {}
            for name in names[rank :: self.writing_ranks]:
                compressed, digest = self.encode(old[name], new[name], encoding, checksum_format)
                if compressed is not None:
                    delta[name], sums[name] = compressed, digest
            per_rank.append((delta, sums))
        counts = [int(bool(delta)) for delta, _ in per_rank]
        total = sum(counts)
        maps: list[dict[str, str]] = []
        for rank, (delta, sums) in enumerate(per_rank):
            offset = sum(counts[:rank])
            fname = None
            if delta:
                fname = f"model-{offset:05d}-of-{total:05d}.safetensors"
                _atomic_write(path / fname, safetensors.numpy.save(delta, metadata=sums))
            maps.append(dict.fromkeys(delta, fname))
        index = {
            "metadata": {
                "version": f"{version:06d}",
                "base_version": f"{version - 1:06d}",
                "delta_encoding": encoding,
                "compression_format": "zstd",
                "checksum_format": checksum_format,
            },
            "weight_map": {name: f for m in maps for name, f in m.items()},
        }
        _atomic_write(path / INDEX, json.dumps(index).encode())
        return path

    @staticmethod
    def encode(
        old_t: torch.Tensor, new_t: torch.Tensor, encoding: str, checksum_format: str
    ) -> tuple[np.ndarray | None, str]:
        """`_encode_delta`'s diff_and_compress: (compressed diff or None if unchanged, new-state checksum)."""
        old, new = tensor_bytes(old_t), tensor_bytes(new_t)
        if encoding == "xor":
            diff = new ^ old
            changed = int(np.count_nonzero(diff))
        elif encoding == "overwrite":
            mask = new != old
            changed = int(np.count_nonzero(mask))
            diff = overwrite_encode(new, mask)
        else:
            raise ValueError(f"unknown delta encoding {encoding!r}")
        if not changed:
            return None, ""
        compressed = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
        return compressed, checksum(checksum_format, new)
