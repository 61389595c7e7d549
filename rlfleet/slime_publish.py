"""Reader of slime's disk weight publishing (THUDM/slime `--update-weight-transport disk`), torch-free.

slime's trainer writes one directory per weight version under `--update-weight-disk-dir`:
`weight_v{N:06d}/`, N = 1, 2, ... (version 0 is the `--hf-checkpoint` itself). Built to slime's code at
commit 624b824a (2026-08-21), read, not run (slime is not installable here):

- **full** (`--update-weight-mode full`, update_weight_from_disk.py + hf_checkpoint_saver.py
  `save_hf_model_to_path`): a complete HF checkpoint: the base's non-weight files copied,
  `model-{i:05d}-of-{n:05d}.safetensors` shards (i from 1), and `model.safetensors.index.json`
  (`{"metadata": {"total_size": ...}, "weight_map": {name: file}}`) written by rank 0 after the shards
  were renamed.
- **delta** (`--update-weight-mode delta`, update_weight_from_disk_delta.py `_write_delta_files`): one
  `model-{offset:05d}-of-{total:05d}.safetensors` per writing rank that changed something (offset from 0,
  no gaps), each changed tensor stored as a 1-D uint8 array, the zstd (level 1) compressed diff of the
  tensor's bytes against version N-1, and the file's `__metadata__` holding, per tensor, the checksum of
  its NEW bytes; then, last, the index, whose metadata says `version` ("%06d"), `base_version` (N-1),
  `delta_encoding` (`xor`: new ^ old; `overwrite`: u4 count, u4 byte positions, the new bytes at them:
  slime/utils/disk_delta.py `overwrite_encode`), `compression_format` `zstd` and `checksum_format`
  (`xxh3-128` | `blake3` | `adler32`: hexdigest). A tensor absent from a delta is unchanged. The first
  delta's base is the bytes of `--hf-checkpoint` (slime seeds its snapshot from it).

The receive side this follows is SGLang's `/pull_weights` of slime's patch
(docker/patch/latest/sglang-pull_weights.patch, `sglang/srt/weight_sync/local_checkpoint.py`): a version
is a delta iff its index metadata has `delta_encoding`; a delta applies to exactly `base_version`; after
applying, each changed tensor's checksum must equal the file's; a full version replaces everything. SGLang
is told by the trainer when a version is written; a watcher is not, so here a version is COMPLETE once its
index exists (slime writes it last in both modes) and every file it names is there: a directory without
the index is refused as incomplete (SGLang would read an index-less directory as a full checkpoint).

Checked beyond what SGLang checks (a bridge that publishes to a fleet must not publish a wrong version):
the directory name pattern, the index's version equal to the directory's N and base_version N-1, known
encoding / compression / checksum, every weight_map file present, a regular file and inside the version
directory (no absolute path, no `..`, no symlink out), every safetensors header well formed and its tensor
names the ones the weight_map gives that file, no stray `*.safetensors` file (SGLang's apply globs them
all), a full version's tensor names, shapes and dtypes those of the base checkpoint, a delta's tensors
known to the base and each diff the size its tensor needs (xor: exactly its bytes; overwrite: positions
inside it). Anything else is refused with ONE line (`SlimePublishError`).

slime's later delta wire layout (its docs at commit 0a664bc5: `indices` / `deltas` / `deltas_zstd`
encodings, `__positions__` / `__values__` tensors, a `DONE` marker) has no code in the snapshot this is
built to: it is detected (the marker, those tensor names, those encodings) and refused with one line
naming what is supported (`NewerLayoutError`).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

INDEX_FILE = "model.safetensors.index.json"
VERSION_DIR = re.compile(r"weight_v(\d{6,})")
DELTA_ENCODINGS = ("xor", "overwrite")
COMPRESSION_FORMATS = ("zstd",)
CHECKSUM_FORMATS = ("xxh3-128", "blake3", "adler32")
NEWER_LAYOUT_ENCODINGS = ("indices", "deltas", "deltas_zstd")
NEWER_LAYOUT_TENSORS = ("__positions__", "__values__")
DONE_MARKER = "DONE"
SUPPORTED = (
    "supported: full HF checkpoints, and deltas with delta_encoding xor|overwrite, compression_format zstd, "
    "checksum_format xxh3-128|blake3|adler32 (slime 624b824a's disk delta)"
)
MAX_INDEX_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own bound

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


class SlimePublishError(Exception):
    """A slime version directory refused: one line naming the directory and what is wrong."""


class NewerLayoutError(SlimePublishError):
    """The directory is in slime's later delta wire layout, which is not supported."""


@dataclass(frozen=True)
class Tensor:
    """One tensor as bytes: safetensors dtype name, shape, its C-order bytes (flat uint8, never mutated)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


Weights = dict[str, Tensor]


@dataclass(frozen=True)
class SlimeVersion:
    """One version's complete weights, as slime published them (checked)."""

    version: int
    kind: Literal["full", "delta"]
    weights: Weights
    changed: tuple[str, ...]
    """The tensors this version changed (a delta: those it holds; a full version: every tensor)."""
    encoding: str = ""
    checksum_format: str = ""


def version_dir_name(version: int) -> str:
    return f"weight_v{version:06d}"


def version_dirs(publish_dir: str | Path) -> dict[int, Path]:
    """Every `weight_v{N:06d}` directory of the publish dir with N >= 1 (slime's own version 0 is its
    hf_checkpoint), by N. Other names (another width, a file, a temporary) are not versions."""
    root = Path(publish_dir)
    found: dict[int, Path] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return found
    for entry in entries:
        m = VERSION_DIR.fullmatch(entry.name)
        if m is None or version_dir_name(int(m.group(1))) != entry.name or int(m.group(1)) < 1:
            continue
        if entry.is_dir():
            found[int(m.group(1))] = root / entry.name
    return dict(sorted(found.items()))


def complete_versions(publish_dir: str | Path) -> list[int]:
    """The versions whose index is written (slime writes it last), ascending; read_version checks the rest."""
    return [v for v, d in version_dirs(publish_dir).items() if (d / INDEX_FILE).is_file()]


def is_delta(version_dir: str | Path) -> bool:
    """SGLang's rule (local_checkpoint.py `_is_delta`): a delta iff its index metadata has delta_encoding.
    SlimePublishError if the index is missing or unreadable."""
    return "delta_encoding" in _read_index(Path(version_dir))[0]


# ------------------------------------------------------------------------------------------ reading
def read_base(checkpoint: str | Path) -> Weights:
    """Every tensor of an HF checkpoint directory's `*.safetensors` files (as slime seeds its snapshot:
    disk_delta.py `make_tensor_reader`). SlimePublishError on a malformed or duplicated tensor."""
    root = Path(checkpoint)
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if not files:
        raise SlimePublishError(f"{root}: no *.safetensors file (not an HF checkpoint directory)")
    out: Weights = {}
    for path in files:
        header, data_start = _read_header(path, root.name)
        for name, info in header.items():
            if name in out:
                raise SlimePublishError(f"{root}: tensor {name} is in two files")
            out[name] = _read_tensor(path, data_start, info)
    return out


def read_version(
    publish_dir: str | Path,
    version: int,
    base: Mapping[str, Tensor],
    previous: tuple[int, Mapping[str, Tensor]] | None,
) -> SlimeVersion:
    """Version `version` of the publish dir, complete and checked. `base`: the base checkpoint's tensors
    (names, shapes, dtypes every version must keep); `previous`: (N-1, its weights), which a delta applies
    to (None, or another version: a delta is refused). SlimePublishError (one line) for anything wrong."""
    vdir = Path(publish_dir) / version_dir_name(version)
    where = vdir.name
    if not vdir.is_dir():
        raise SlimePublishError(f"{where}: no such version directory in {publish_dir}")
    _refuse_newer_layout(vdir)
    metadata, weight_map = _read_index(vdir)
    files = _check_files(vdir, weight_map)
    if "delta_encoding" not in metadata:
        return _read_full(vdir, version, files, base)
    return _read_delta(vdir, version, metadata, files, base, previous)


def _refuse_newer_layout(vdir: Path) -> None:
    where = vdir.name
    if (vdir / DONE_MARKER).exists():
        raise NewerLayoutError(
            f"{where}: slime's newer delta wire layout (a {DONE_MARKER} marker) is not supported; {SUPPORTED}"
        )
    try:
        metadata = _read_index(vdir)[0]
    except SlimePublishError:
        metadata = {}
    encoding = metadata.get("delta_encoding", metadata.get("encoding"))
    if encoding in NEWER_LAYOUT_ENCODINGS or ("encoding" in metadata and "delta_encoding" not in metadata):
        raise NewerLayoutError(
            f"{where}: slime's newer delta wire layout (encoding {encoding!r}) is not supported; {SUPPORTED}"
        )
    for path in sorted(vdir.glob("*.safetensors")):
        try:
            header, _ = _read_header(path, where)
        except SlimePublishError:
            continue  # the checks that follow say what is wrong with it
        newer = sorted(set(header) & set(NEWER_LAYOUT_TENSORS))
        if newer:
            raise NewerLayoutError(
                f"{where}: slime's newer delta wire layout ({path.name} holds {', '.join(newer)}) is not "
                f"supported; {SUPPORTED}"
            )


def _read_index(vdir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(metadata, weight_map) of a version's index."""
    where = vdir.name
    path = vdir / INDEX_FILE
    try:
        size = path.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise SlimePublishError(f"{where}: {INDEX_FILE} is {size} bytes (over {MAX_INDEX_BYTES})")
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise SlimePublishError(
            f"{where}: incomplete: no {INDEX_FILE} yet (slime writes it last); retried at the next poll"
        ) from None
    except (OSError, ValueError) as e:
        raise SlimePublishError(f"{where}: {INDEX_FILE} unreadable ({_short(e)})") from None
    metadata = raw.get("metadata", {}) if isinstance(raw, dict) else None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(metadata, dict) or not isinstance(weight_map, dict):
        raise SlimePublishError(f"{where}: {INDEX_FILE} has no metadata object and weight_map object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise SlimePublishError(f"{where}: {INDEX_FILE}: weight_map must map tensor names to file names")
    return metadata, weight_map


def _check_files(vdir: Path, weight_map: Mapping[str, str]) -> dict[Path, list[str]]:
    """weight_map's files (each present, regular, inside the version dir) -> the tensors it holds; no
    `*.safetensors` file of the dir outside the weight_map."""
    where = vdir.name
    root = vdir.resolve()
    files: dict[Path, list[str]] = {}
    for name, rel in weight_map.items():
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts or "\\" in rel:
            raise SlimePublishError(
                f"{where}: weight_map file {rel!r} of {name} is not inside the version directory"
            )
        path = vdir / rel
        try:
            resolved = path.resolve(strict=True)
        except (FileNotFoundError, RuntimeError):
            raise SlimePublishError(
                f"{where}: incomplete: {rel} (of {name}) is missing; retried at the next poll"
            ) from None
        if not resolved.is_relative_to(root):
            raise SlimePublishError(
                f"{where}: weight_map file {rel!r} of {name} leads outside the version directory"
            )
        if not resolved.is_file():
            raise SlimePublishError(f"{where}: weight_map file {rel!r} is not a regular file")
        files.setdefault(path, []).append(name)
    named = {p.resolve() for p in files}
    stray = sorted(p.name for p in vdir.glob("*.safetensors") if p.resolve() not in named)
    if stray:
        raise SlimePublishError(
            f"{where}: {stray[0]} is not in the index's weight_map (a partial or foreign write)"
        )
    return files


def _read_header(path: Path, where: str) -> tuple[dict[str, dict[str, Any]], int]:
    """The tensors of a safetensors file's header (its `__metadata__` left out: `_file_metadata`), each
    entry checked against the file's size; and where its data starts."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SlimePublishError(f"{where}: {path.name} is truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise SlimePublishError(
                    f"{where}: {path.name}: safetensors header of {header_len} bytes does not fit"
                )
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise SlimePublishError(f"{where}: {path.name} unreadable ({_short(e)})") from None
    except ValueError as e:
        raise SlimePublishError(
            f"{where}: {path.name}: safetensors header is not JSON ({_short(e)})"
        ) from None
    if not isinstance(header, dict):
        raise SlimePublishError(f"{where}: {path.name}: safetensors header is not an object")
    data_start = 8 + header_len
    out: dict[str, dict[str, Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        _check_entry(info, size - data_start, f"{where}: {path.name}: {name}")
        out[name] = info
    return out, data_start


def _file_metadata(path: Path, where: str) -> dict[str, str]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(header_len)).get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise SlimePublishError(f"{where}: {path.name}: __metadata__ is not an object")
    return {str(k): str(v) for k, v in meta.items()}


def _check_entry(info: Any, data_size: int, what: str) -> None:
    ok = (
        isinstance(info, dict)
        and info.get("dtype") in DTYPE_BYTES
        and isinstance(info.get("shape"), list)
        and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and all(isinstance(o, int) for o in info["data_offsets"])
    )
    if not ok:
        raise SlimePublishError(f"{what}: malformed safetensors entry")
    begin, end = info["data_offsets"]
    nbytes = math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]
    if not 0 <= begin <= end <= data_size or end - begin != nbytes:
        raise SlimePublishError(
            f"{what}: data_offsets {begin}..{end} do not hold {nbytes} bytes inside the file (truncated?)"
        )


def _read_tensor(path: Path, data_start: int, info: Mapping[str, Any]) -> Tensor:
    begin, end = info["data_offsets"]
    data = np.fromfile(path, dtype=np.uint8, count=end - begin, offset=data_start + begin)
    return Tensor(str(info["dtype"]), tuple(info["shape"]), data)


def _file_tensors(
    vdir: Path, files: Mapping[Path, list[str]]
) -> list[tuple[Path, int, dict[str, dict[str, Any]]]]:
    """(file, data start, header) per weight_map file; its tensors exactly the ones the map gives it."""
    where = vdir.name
    out = []
    for path, names in files.items():
        header, data_start = _read_header(path, where)
        if set(header) != set(names):
            extra = sorted(set(header) - set(names))
            missing = sorted(set(names) - set(header))
            what = f"holds {extra[0]}, not in the weight_map" if extra else f"lacks {missing[0]}"
            raise SlimePublishError(f"{where}: {path.name} {what}")
        out.append((path, data_start, header))
    return out


def _read_full(
    vdir: Path, version: int, files: Mapping[Path, list[str]], base: Mapping[str, Tensor]
) -> SlimeVersion:
    where = vdir.name
    names = {n for ns in files.values() for n in ns}
    if names != set(base):
        missing, extra = sorted(set(base) - names), sorted(names - set(base))
        what = (
            f"lacks the base's tensor {missing[0]}" if missing else f"has tensor {extra[0]}, not in the base"
        )
        raise SlimePublishError(
            f"{where}: full checkpoint {what} ({len(missing)} missing, {len(extra)} extra)"
        )
    weights: Weights = {}
    for path, data_start, header in _file_tensors(vdir, files):
        for name, info in header.items():
            want = base[name]
            if info["dtype"] != want.dtype or tuple(info["shape"]) != want.shape:
                raise SlimePublishError(
                    f"{where}: {name} is {info['dtype']}{list(info['shape'])}, the base's is "
                    f"{want.dtype}{list(want.shape)} (a shape or dtype change is not a weight update)"
                )
            weights[name] = _read_tensor(path, data_start, info)
    return SlimeVersion(version, "full", weights, tuple(sorted(weights)))


def _check_delta_metadata(where: str, version: int, metadata: Mapping[str, Any]) -> tuple[str, str]:
    """(encoding, checksum format) of a delta index whose metadata is what slime writes for `version`."""

    def number(key: str) -> int:
        value = metadata.get(key)
        if not isinstance(value, str) or not value.isdigit():
            raise SlimePublishError(f"{where}: index metadata {key} {value!r} is not a version number")
        return int(value)

    if number("version") != version:
        raise SlimePublishError(
            f"{where}: index says version {metadata['version']}, the directory is version {version}"
        )
    if number("base_version") != version - 1:
        raise SlimePublishError(
            f"{where}: delta builds on base_version {metadata['base_version']}, not {version - 1:06d} "
            "(slime's deltas chain one version to the next)"
        )
    encoding = metadata.get("delta_encoding")
    if encoding not in DELTA_ENCODINGS:
        raise SlimePublishError(f"{where}: unknown delta_encoding {encoding!r}; {SUPPORTED}")
    if metadata.get("compression_format") not in COMPRESSION_FORMATS:
        raise SlimePublishError(
            f"{where}: unknown compression_format {metadata.get('compression_format')!r}; {SUPPORTED}"
        )
    algorithm = metadata.get("checksum_format")
    if algorithm not in CHECKSUM_FORMATS:
        raise SlimePublishError(f"{where}: unknown checksum_format {algorithm!r}; {SUPPORTED}")
    return str(encoding), str(algorithm)


def _read_delta(
    vdir: Path,
    version: int,
    metadata: Mapping[str, Any],
    files: Mapping[Path, list[str]],
    base: Mapping[str, Tensor],
    previous: tuple[int, Mapping[str, Tensor]] | None,
) -> SlimeVersion:
    where = vdir.name
    encoding, algorithm = _check_delta_metadata(where, version, metadata)
    if previous is None or previous[0] != version - 1:
        held = "nothing" if previous is None else f"v{previous[0]}"
        raise SlimePublishError(f"{where}: delta on v{version - 1}, but the bridge holds {held}")
    old = previous[1]
    weights: Weights = dict(old)
    mismatches: list[str] = []
    for path, data_start, header in _file_tensors(vdir, files):
        checksums = _file_metadata(path, where)
        for name, info in header.items():
            if name not in base or name not in old:
                raise SlimePublishError(
                    f"{where}: delta for {name}, a tensor the base checkpoint does not have"
                )
            if info["dtype"] != "U8" or len(info["shape"]) != 1:
                raise SlimePublishError(
                    f"{where}: {name}: a delta is a 1-D U8 array, got {info['dtype']}{info['shape']}"
                )
            want = checksums.get(name)
            if want is None:
                raise SlimePublishError(f"{where}: {path.name} has no checksum for {name} in its metadata")
            blob = _read_tensor(path, data_start, info).data.tobytes()
            new = _apply(where, name, encoding, old[name], blob)
            if _checksum(algorithm, new) != want:
                mismatches.append(name)
            weights[name] = Tensor(old[name].dtype, old[name].shape, new)
    if mismatches:
        raise SlimePublishError(
            f"{where}: {algorithm} checksum mismatch for {len(mismatches)} tensor(s) after applying the "
            f"{encoding} delta: {', '.join(sorted(mismatches)[:3])}"
        )
    changed = tuple(sorted(n for ns in files.values() for n in ns))
    return SlimeVersion(version, "delta", weights, changed, encoding, algorithm)


def _apply(where: str, name: str, encoding: str, old: Tensor, blob: bytes) -> np.ndarray:
    """The tensor's new bytes (a new array: `old` is never written)."""
    nbytes = int(old.data.size)
    if encoding == "xor":
        diff = _decompress(where, name, blob, nbytes)
        if len(diff) != nbytes:
            raise SlimePublishError(
                f"{where}: {name}: xor diff of {len(diff)} bytes for a tensor of {nbytes} "
                f"({old.dtype}{list(old.shape)}: a shape change is not a weight update)"
            )
        return np.bitwise_xor(old.data, np.frombuffer(diff, dtype=np.uint8))
    raw = _decompress(where, name, blob, 4 + 5 * nbytes)
    count = int.from_bytes(raw[:4], "little") if len(raw) >= 4 else -1
    if count < 0 or len(raw) != 4 + 5 * count:
        raise SlimePublishError(
            f"{where}: {name}: overwrite delta of {len(raw)} bytes is not count+positions+values"
        )
    positions = np.frombuffer(raw, dtype="<u4", count=count, offset=4)
    if count and int(positions.max()) >= nbytes:
        raise SlimePublishError(
            f"{where}: {name}: overwrite position {int(positions.max())} outside its {nbytes} bytes "
            f"({old.dtype}{list(old.shape)}: a shape change is not a weight update)"
        )
    new = old.data.copy()
    new[positions] = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * count)
    return new


def _decompress(where: str, name: str, blob: bytes, limit: int) -> bytes:
    """zstd-decompress at most `limit` + 1 bytes (a longer diff is refused by the caller's size check)."""
    import zstandard

    out = io.BytesIO()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as reader:
            while out.tell() <= limit:
                chunk = reader.read(4 << 20)
                if not chunk:
                    break
                out.write(chunk)
    except zstandard.ZstdError as e:
        raise SlimePublishError(f"{where}: {name}: zstd payload does not decompress ({_short(e)})") from None
    return out.getvalue()


def _checksum(algorithm: str, data: np.ndarray) -> str:
    """slime/utils/disk_delta.py `checksum`: the hexdigest of the tensor's bytes."""
    buf = np.ascontiguousarray(data).data
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128(buf).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(buf).hexdigest()
    return f"{zlib.adler32(buf, 1):08x}"


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__
