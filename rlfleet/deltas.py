"""Lossless sparse deltas between two versions of one safetensors file (docs/weights.md, "Deltas").

Between two RL optimizer steps almost every stored element of a view is bit-identical (bf16 values absorb
updates below |w|/256; fp8 and nvfp4 codes change even less). A delta keeps, per tensor, the changed
elements only: their flat indices and their new values, in the tensor's STORED element width (bf16: 2 bytes,
fp8 codes and packed nvfp4 bytes: 1, fp32 scales: 4), compared bit for bit. No compression, no
floating-point arithmetic: applying a delta to the exact base file gives the target file byte for byte,
which the manifest's BLAKE3 digest of the target file then proves (the caller verifies; a torn or wrong
base gives a digest mismatch, never a silently wrong file).

A delta is itself a safetensors file (`<file>.delta` in the channel), torch-free (numpy):

    "<tensor>:idx"   U32 (U64 above 2^32 elements) [k]  flat indices of the changed elements, ascending
    "<tensor>:val"   U8 / U16 / U32 / U64 [k]            their new values, raw bits of the stored dtype
    __metadata__     {"format": "rlfleet.delta/v1", "header_bytes": "<8 + n>", "file_bytes": "<size>",
                      "header_blake3": "<hex of the shared safetensors header>"}

A delta exists only between two files with the SAME safetensors header (names, dtypes, shapes, offsets,
metadata: the case of consecutive versions of one view) and the same bytes outside every tensor (a file
whose tensors do not cover its data has such bytes; safetensors' own reader refuses it); otherwise the file
is stored whole. `apply_delta` refuses (DeltaError) a delta that is not exactly this layout: another format,
another base's header or size, an entry of a tensor the base lacks, an index out of its tensor or not
strictly ascending, a value of another width than the tensor's stored element, an index without its values.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

DELTA_FORMAT = "rlfleet.delta/v1"
DELTA_SUFFIX = ".delta"
"""A file `<rel>` of a view stored as a delta is the channel key `v{N}/{view}/<rel>.delta`."""
INDEX_SUFFIX = ":idx"
VALUE_SUFFIX = ":val"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""safetensors' own bound on a header (the Rust reader refuses larger)."""
CHUNK_ELEMENTS = 1 << 24
"""Elements compared per numpy pass (bounds the temporary boolean mask to 16 MiB)."""
ELEMENT_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
"""Stored element width per safetensors dtype; a dtype not listed is compared byte by byte."""


class DeltaError(ValueError):
    """A delta that does not fit its base or is malformed: never applied."""


@dataclass(frozen=True)
class DeltaStats:
    """What one encoded delta holds, against the full file it stands for."""

    file_bytes: int
    """Size of the full (target) file."""
    delta_bytes: int
    """Size of the delta file written."""
    elements: int
    changed_elements: int
    tensors: int
    changed_tensors: int


@dataclass(frozen=True)
class _Header:
    data_start: int  # 8 + header length: where tensor data begins
    raw: bytes  # the header's JSON bytes, as stored
    tensors: dict[str, tuple[str, int, int]]  # name -> (dtype, begin, end) relative to data_start


def read_header(path: Path) -> _Header:
    """The safetensors header of `path`, bounded; DeltaError if it is not a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise DeltaError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise DeltaError(f"{path.name}: safetensors header of {length} bytes does not fit the file")
        raw = f.read(length)
    try:
        parsed = json.loads(raw)
        tensors = {}
        for name, info in parsed.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in info["data_offsets"])
            if not 0 <= begin <= end <= size - 8 - length:
                raise DeltaError(f"{path.name}: tensor {name!r} lies outside the file")
            tensors[name] = (str(info["dtype"]), begin, end)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, DeltaError):
            raise
        raise DeltaError(f"{path.name}: malformed safetensors header ({type(e).__name__}: {e})") from None
    return _Header(8 + length, raw, tensors)


def _unit(dtype: str, nbytes: int) -> np.dtype:
    width = ELEMENT_BYTES.get(dtype, 1)
    if nbytes % width:
        width = 1
    return np.dtype(f"<u{width}")


def _elements(mm: np.memmap, header: _Header, begin: int, end: int, unit: np.dtype) -> np.ndarray:
    return mm[header.data_start + begin : header.data_start + end].view(unit)


def _uncovered(header: _Header, file_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges of the data section (file offsets) that no tensor covers."""
    gaps, at = [], header.data_start
    for _, begin, end in sorted(header.tensors.values(), key=lambda t: (t[1], t[2])):
        if header.data_start + begin > at:
            gaps.append((at, header.data_start + begin))
        at = max(at, header.data_start + end)
    if file_bytes > at:
        gaps.append((at, file_bytes))
    return gaps


def encode_delta(base: Path, target: Path, out: Path, *, max_delta_bytes: int | None = None) -> DeltaStats | None:
    """Write the delta taking `base` to `target` into `out` (a safetensors file, module docstring).

    None (and nothing written) when the two headers or sizes differ, or bytes outside every tensor differ,
    so the file must be stored whole, or when the delta would exceed `max_delta_bytes` (it stops comparing
    as soon as it does: an anchor is cheaper). DeltaError if either is not a safetensors file."""
    base_header, target_header = read_header(base), read_header(target)
    file_bytes = os.path.getsize(target)
    if base_header.raw != target_header.raw or os.path.getsize(base) != file_bytes:
        return None
    old = np.memmap(base, dtype=np.uint8, mode="r")
    new = np.memmap(target, dtype=np.uint8, mode="r")
    if any(not np.array_equal(old[a:b], new[a:b]) for a, b in _uncovered(target_header, file_bytes)):
        return None
    payload: dict[str, np.ndarray] = {}
    elements = changed = payload_bytes = 0
    for name, (dtype, begin, end) in sorted(target_header.tensors.items()):
        unit = _unit(dtype, end - begin)
        a = _elements(old, base_header, begin, end, unit)
        b = _elements(new, target_header, begin, end, unit)
        count = len(b)
        elements += count
        index_dtype = np.uint32 if count <= 1 << 32 else np.uint64
        parts = [
            (np.flatnonzero(a[i : i + CHUNK_ELEMENTS] != b[i : i + CHUNK_ELEMENTS]) + i).astype(index_dtype)
            for i in range(0, count, CHUNK_ELEMENTS)
        ]
        index = np.concatenate(parts) if parts else np.zeros(0, dtype=index_dtype)
        if len(index) == 0:
            continue
        payload[name + INDEX_SUFFIX] = index
        payload[name + VALUE_SUFFIX] = np.ascontiguousarray(b[index])
        changed += len(index)
        payload_bytes += len(index) * (index.itemsize + unit.itemsize)
        if max_delta_bytes is not None and payload_bytes > max_delta_bytes:
            return None
    from safetensors.numpy import save_file  # the sampler and trainer extras install it

    metadata = {
        "format": DELTA_FORMAT,
        "header_bytes": str(target_header.data_start),
        "file_bytes": str(file_bytes),
        "header_blake3": blake3.blake3(target_header.raw).hexdigest(),
    }
    save_file(payload, str(out), metadata=metadata)
    return DeltaStats(
        file_bytes=file_bytes,
        delta_bytes=os.path.getsize(out),
        elements=elements,
        changed_elements=changed,
        tensors=len(target_header.tensors),
        changed_tensors=len(payload) // 2,
    )


def apply_delta(base: Path, delta: Path, out: Path) -> None:
    """Write `base` with the delta's elements set into `out` (fsynced). DeltaError if the delta is malformed
    or was not made against a file with `base`'s header and size; a base with other DATA gives a file whose
    digest the caller's verification refuses."""
    header = read_header(base)
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(delta), framework="numpy") as d:
            metadata = d.metadata() or {}
            keys = list(d.keys())
            if metadata.get("format") != DELTA_FORMAT:
                raise DeltaError(f"{delta.name}: not an {DELTA_FORMAT} file (format {metadata.get('format')!r})")
            if (
                metadata.get("header_bytes") != str(header.data_start)
                or metadata.get("file_bytes") != str(os.path.getsize(base))
                or metadata.get("header_blake3") != blake3.blake3(header.raw).hexdigest()
            ):
                raise DeltaError(f"{delta.name}: made against another file than the base {base.name}")
            names = sorted({k.removesuffix(INDEX_SUFFIX) for k in keys if k.endswith(INDEX_SUFFIX)})
            if sorted(keys) != sorted([n + INDEX_SUFFIX for n in names] + [n + VALUE_SUFFIX for n in names]):
                raise DeltaError(f"{delta.name}: every tensor needs exactly one {INDEX_SUFFIX} and one {VALUE_SUFFIX}")
            tmp = out.parent / f".{out.name}.applying"
            shutil.copyfile(base, tmp)  # in-kernel copy; then only the changed elements are written
            try:
                mm = np.memmap(tmp, dtype=np.uint8, mode="r+")
                for name in names:
                    if name not in header.tensors:
                        raise DeltaError(f"{delta.name}: tensor {name!r} is not in the base file")
                    dtype, begin, end = header.tensors[name]
                    unit = _unit(dtype, end - begin)
                    target = _elements(mm, header, begin, end, unit)
                    try:
                        index, values = d.get_tensor(name + INDEX_SUFFIX), d.get_tensor(name + VALUE_SUFFIX)
                    except (TypeError, ValueError) as e:  # a dtype numpy has no type for (e.g. BF16)
                        raise DeltaError(f"{delta.name}: the entry of {name!r} is not U8..U64 ({e})") from None
                    if (
                        index.ndim != 1
                        or values.shape != index.shape
                        or index.dtype.kind != "u"
                        or values.dtype != unit
                        or (len(index) and int(index[-1]) >= len(target))
                        or (len(index) > 1 and not bool(np.all(index[1:] > index[:-1])))
                    ):
                        raise DeltaError(
                            f"{delta.name}: the entry of {name!r} does not fit its tensor (indices below "
                            f"{len(target)}, strictly ascending, and as many values of {unit.itemsize} bytes)"
                        )
                    target[index] = values
                mm.flush()
                del mm
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, out)
            finally:
                tmp.unlink(missing_ok=True)
    except SafetensorError as e:
        raise DeltaError(f"{delta.name}: not a readable safetensors file ({e})") from None
