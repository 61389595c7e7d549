"""Lossless sparse deltas between two versions of one safetensors file (docs/weights.md, "Deltas").

Between two RL optimizer steps almost every stored element of a view is bit-identical (bf16 values absorb
updates below |w|/256; fp8 and nvfp4 codes change even less). A delta keeps, per tensor, the changed
elements only: their flat indices and their new values, in the tensor's STORED element width (bf16: 2 bytes,
fp8 codes and packed nvfp4 bytes: 1, fp32 scales: 4), compared bit for bit. No compression, no
floating-point arithmetic: applying a delta to the exact base file gives the target file byte for byte,
which the manifest's BLAKE3 digest of the target file then proves (the caller verifies; a torn or wrong
base gives a digest mismatch, never a silently wrong file).

A delta is itself a safetensors file (`<file>.delta` in the channel), torch-free (numpy):

    "<tensor>:gap"   U8 [m >= k]                 the changed elements' flat indices, gap coded (below)
    "<tensor>:val"   U8 / U16 / U32 / U64 [k]    their new values, raw bits of the stored dtype
    __metadata__     {"format": "rlfleet.delta/v2", "header_bytes": "<8 + n>", "file_bytes": "<size>",
                      "header_blake3": "<hex of the shared safetensors header>"}

Gap coding (v2; v1 stored U32 indices, 4 bytes per changed element): the gaps between consecutive changed
indices, the first from -1 (so every gap g >= 1), each written as floor((g - 1) / 255) bytes 0 ("+255,
go on") and one byte (g - 1) % 255 + 1 in 1..255. A nonzero byte ends an element: index = the running sum
of (byte or 255 for a 0) at each nonzero byte, minus 1. An element costs one byte where its gap is at most
255 (bf16 at lr 1e-6 changes ~1.7% of its elements: mean gap ~60), and a tensor's zero bytes are at most
its elements / 255 whatever the rate.

A delta exists only between two files with the SAME safetensors header (names, dtypes, shapes, offsets,
metadata: the case of consecutive versions of one view) and the same bytes outside every tensor (a file
whose tensors do not cover its data has such bytes; safetensors' own reader refuses it); otherwise the file
is stored whole. `apply_delta` refuses (DeltaError) a delta that is not exactly this layout: another format,
another base's header or size, an entry of a tensor the base lacks, a gap stream that is not U8, runs past
its tensor, ends in a 0 byte (an unfinished gap) or codes another count of elements than its values, a
value of another width than the tensor's stored element.

Both directions stream (memory: a few chunks, whatever the view's size): `encode_delta` writes every gap
block, then every value block, a chunk at a time (a chunk's first gap continues from the previous chunk's
last index), and puts the header in front; `apply_delta` decodes one tensor's gaps at a time (a block of
bytes at a time, into U32 indices, U64 above 2^32 elements) and reads, sets, hashes and writes the file
1 MiB at a time, so applying and verifying cost about one copy of the view (benchmarks/weight_deltas.py, docs/benchmarks.md "Lossless sparse deltas").
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import blake3
import numpy as np

DELTA_FORMAT = "rlfleet.delta/v2"
DELTA_SUFFIX = ".delta"
"""A file `<rel>` of a view stored as a delta is the channel key `v{N}/{view}/<rel>.delta`."""
GAP_SUFFIX = ":gap"
GAP_STEP = 255
"""What a 0 byte of a gap stream adds before the gap goes on (the largest gap one byte ends)."""
VALUE_SUFFIX = ":val"
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""safetensors' own bound on a header (the Rust reader refuses larger)."""
CHUNK_ELEMENTS = 1 << 24
"""Elements compared per numpy pass (bounds the temporary boolean mask to 16 MiB)."""
GAP_DECODE_BYTES = 1 << 20
"""Bytes of a gap stream decoded per numpy pass (bounds the int64 temporaries to a few times 8 MiB)."""
CHUNK_BYTES = 1 << 20
"""Bytes read, set, hashed and written per pass when a delta is applied (a multiple of 8). 1 MiB: on the
benchmark's box, pread + pwrite of 16 MiB buffers ran 4-5x slower than of 1 MiB ones (which match the
kernel's copy_file_range), benchmarks/weight_deltas.py."""
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
    at, previous = 0, ""
    for name, (_, begin, end) in sorted(tensors.items(), key=lambda t: (t[1][1], t[1][2])):
        if begin < at:  # safetensors' own reader refuses it too
            raise DeltaError(f"{path.name}: tensors {previous!r} and {name!r} overlap")
        at, previous = end, name
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


def encode_delta(
    base: Path, target: Path, out: Path, *, max_delta_bytes: int | None = None
) -> DeltaStats | None:
    """Write the delta taking `base` to `target` into `out` (a safetensors file, module docstring).

    None (and nothing written) when the two headers or sizes differ, or bytes outside every tensor differ,
    so the file must be stored whole, or when the delta would exceed `max_delta_bytes` (it stops comparing
    as soon as it does, CHUNK_ELEMENTS at a time: an anchor is cheaper). DeltaError if either is not a
    safetensors file.

    Streaming: the changed elements go to disk a chunk at a time (every gap block, then every value
    block, then the header in front), so its memory is a few chunks', whatever the view's size."""
    base_header, target_header = read_header(base), read_header(target)
    file_bytes = os.path.getsize(target)
    if base_header.raw != target_header.raw or os.path.getsize(base) != file_bytes:
        return None
    old = np.memmap(base, dtype=np.uint8, mode="r")
    new = np.memmap(target, dtype=np.uint8, mode="r")
    if any(not np.array_equal(old[a:b], new[a:b]) for a, b in _uncovered(target_header, file_bytes)):
        return None
    indices_tmp, values_tmp, tmp = (out.parent / f".{out.name}.{part}" for part in ("gap", "val", "writing"))
    try:
        with open(indices_tmp, "wb") as fi, open(values_tmp, "wb") as fv:
            found = _changes(old, new, target_header, fi, fv, max_delta_bytes)
        if found is None:
            return None
        blocks, elements = found
        header: dict[str, object] = {
            "__metadata__": {
                "format": DELTA_FORMAT,
                "header_bytes": str(target_header.data_start),
                "file_bytes": str(file_bytes),
                "header_blake3": blake3.blake3(target_header.raw).hexdigest(),
            }
        }
        offset = 0
        for key, dtype, k, nbytes in blocks:
            header[key] = {"dtype": dtype, "shape": [k], "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # as safetensors pads it
        with open(tmp, "wb") as f, open(indices_tmp, "rb") as fi, open(values_tmp, "rb") as fv:
            f.write(struct.pack("<Q", len(text)) + text)
            f.flush()
            at = 8 + len(text)
            for src, nbytes in ((fi, os.path.getsize(indices_tmp)), (fv, os.path.getsize(values_tmp))):
                _copy_range(src.fileno(), f.fileno(), 0, at, nbytes)
                at += nbytes
        os.replace(tmp, out)
    finally:
        for path in (indices_tmp, values_tmp, tmp):
            path.unlink(missing_ok=True)
    return DeltaStats(
        file_bytes=file_bytes,
        delta_bytes=os.path.getsize(out),
        elements=elements,
        changed_elements=sum(k for key, _, k, _ in blocks if key.endswith(VALUE_SUFFIX)),
        tensors=len(target_header.tensors),
        changed_tensors=len(blocks) // 2,
    )


def _changes(
    old: np.memmap, new: np.memmap, header: _Header, fi: BinaryIO, fv: BinaryIO, max_delta_bytes: int | None
) -> tuple[list[tuple[str, str, int, int]], int] | None:
    """Write the changed elements' gap-coded indices to `fi` and their new values to `fv`, tensor by tensor
    in name order; return the blocks (key, dtype, elements, bytes: every gap block, then every value block)
    and the elements compared, or None as soon as the payload exceeds `max_delta_bytes`."""
    indices: list[tuple[str, str, int, int]] = []
    values: list[tuple[str, str, int, int]] = []
    elements = payload_bytes = 0
    for name, (dtype, begin, end) in sorted(header.tensors.items()):
        unit = _unit(dtype, end - begin)
        a, b = _elements(old, header, begin, end, unit), _elements(new, header, begin, end, unit)
        elements += len(b)
        k = m = 0
        last = -1  # the previous changed index of this tensor: gaps go on across chunks
        for i in range(0, len(b), CHUNK_ELEMENTS):
            new_part = b[i : i + CHUNK_ELEMENTS]
            local = np.flatnonzero(a[i : i + CHUNK_ELEMENTS] != new_part)
            if not len(local):
                continue
            gaps = _gap_bytes(local + i, last)
            payload_bytes += len(gaps) + len(local) * unit.itemsize
            if max_delta_bytes is not None and payload_bytes > max_delta_bytes:
                return None
            fv.write(np.ascontiguousarray(new_part[local]).data)
            fi.write(gaps.data)
            k, m, last = k + len(local), m + len(gaps), int(local[-1]) + i
        if k:
            indices.append((name + GAP_SUFFIX, "U8", m, m))
            values.append((name + VALUE_SUFFIX, f"U{8 * unit.itemsize}", k, k * unit.itemsize))
    return indices + values, elements


def _gap_bytes(index: np.ndarray, last: int) -> np.ndarray:
    """The gap coding (module docstring) of the ascending `index` following the changed index `last` (-1:
    none before): per gap g, (g - 1) // 255 bytes 0, then (g - 1) % 255 + 1."""
    g = np.diff(index, prepend=last)
    if not len(g) or int(g.max()) <= GAP_STEP:  # one byte each (a dense chunk): no 0 bytes to place
        return g.astype(np.uint8)
    g -= 1
    ends = np.cumsum(g // GAP_STEP + 1) - 1  # where each element's last byte goes
    out = np.zeros(int(ends[-1]) + 1, dtype=np.uint8)
    g %= GAP_STEP
    g += 1
    out[ends] = g
    return out


def _gap_index(gaps: np.ndarray, count: int) -> np.ndarray | None:
    """The ascending indices a gap stream codes (U32 below 2^32 elements, else U64), GAP_DECODE_BYTES at a
    time; None if it runs past `count` or ends in a 0 byte (an unfinished gap)."""
    index = np.empty(np.count_nonzero(gaps), dtype=np.uint32 if count <= 1 << 32 else np.uint64)
    if len(gaps) and gaps[-1] == 0:
        return None
    last, last_end, done = -1, -1, 0  # the previous index, the position of its byte, elements decoded
    for start in range(0, len(gaps), GAP_DECODE_BYTES):
        block = gaps[start : start + GAP_DECODE_BYTES]
        if np.count_nonzero(block) == len(block) and last_end == start - 1:  # no 0 byte: each byte a gap
            local = np.cumsum(block, dtype=np.int64)
            local += last
            ends = np.array([start + len(block) - 1])
        else:
            ends = np.flatnonzero(block) + start
            if not len(ends):
                continue
            # an element's gap: 255 per 0 byte since the previous element's byte, plus its own byte
            local = np.cumsum((np.diff(ends, prepend=last_end) - 1) * GAP_STEP + gaps[ends]) + last
        if int(local[-1]) >= count:
            return None
        index[done : done + len(local)] = local
        last, last_end, done = int(local[-1]), int(ends[-1]), done + len(local)
    return index


class _ShortSource(Exception):
    """The file being read ended before the bytes its header promises (it changed under the reader)."""


class Hasher(Protocol):
    """A streaming digest (blake3.blake3, hashlib.sha256: both release the GIL on large buffers)."""

    def update(self, data: memoryview, /) -> object: ...


def _copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy `count` bytes between two file descriptors at the given offsets: in the kernel where it can
    (copy_file_range), else through a buffer. _ShortSource if the source ends first."""
    try:
        while count > 0:
            n = os.copy_file_range(src, dst, min(count, 1 << 30), src_offset, dst_offset)
            if n <= 0:
                raise _ShortSource
            src_offset, dst_offset, count = src_offset + n, dst_offset + n, count - n
        return
    except (AttributeError, OSError):  # no copy_file_range here (or not across these filesystems)
        pass
    while count > 0:
        data = os.pread(src, min(count, CHUNK_BYTES), src_offset)
        if not data:
            raise _ShortSource
        _pwrite_all(dst, data, dst_offset)
        src_offset, dst_offset, count = src_offset + len(data), dst_offset + len(data), count - len(data)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def apply_delta(base: Path, delta: Path, out: Path, *, hasher: Hasher | None = None) -> int:
    """Write `base` with the delta's elements set into `out` and return its size; `hasher` (if given) is
    fed every byte of `out` in order, in the same pass, so the caller verifies the rebuilt file without
    reading it again. DeltaError if the delta is malformed or was not made against a file with `base`'s
    header and size (nothing written: the file is built under a temporary name and renamed only when every
    entry fitted); a base with other DATA gives a file whose digest the caller's verification refuses.

    One sequential pass over the base, CHUNK_BYTES at a time (read, set the chunk's elements in memory,
    hash it in a second thread while it is written): the bytes are read from memory once for the write
    and the digest, so applying + verifying costs about one copy (docs/benchmarks.md, "Lossless sparse
    deltas"). Setting the elements through a mapping of a copy would fault in and dirty every page anyway
    (at 0.4% of bf16 elements changed, every 4 KiB page holds about 8). One tensor's entries are in memory
    at a time. Not fsynced, like a download (`Store.get_file`): the rebuilt file is a cache whose every use
    as a base is verified again (WeightChannel.obtain_view)."""
    from safetensors import SafetensorError, safe_open

    header = read_header(base)
    size = os.path.getsize(base)
    tmp = out.parent / f".{out.name}.applying"
    try:
        with safe_open(str(delta), framework="numpy") as d:
            names = _checked_names(d, base, delta, header, size)
            with open(base, "rb") as src, open(tmp, "wb") as dst:
                patches = (_patch(d, delta, name, header) for name in names)
                _write_patched(src.fileno(), dst.fileno(), size, patches, hasher)
        os.replace(tmp, out)
    except SafetensorError as e:
        raise DeltaError(f"{delta.name}: not a readable safetensors file ({e})") from None
    except _ShortSource:
        raise DeltaError(f"{base.name}: shorter than its header says (changed while applying?)") from None
    finally:
        tmp.unlink(missing_ok=True)
    return size


_Patch = tuple[int, int, np.dtype, np.ndarray, np.ndarray]  # file begin, file end, unit, indices, values


def _checked_names(d: Any, base: Path, delta: Path, header: _Header, size: int) -> list[str]:
    """The tensors the delta changes, in file order, once its metadata names `base`'s header and size and
    its keys are exactly one gap and one value entry per tensor of the base; DeltaError otherwise."""
    metadata = d.metadata() or {}
    keys = list(d.keys())
    if metadata.get("format") != DELTA_FORMAT:
        raise DeltaError(f"{delta.name}: not an {DELTA_FORMAT} file (format {metadata.get('format')!r})")
    if (
        metadata.get("header_bytes") != str(header.data_start)
        or metadata.get("file_bytes") != str(size)
        or metadata.get("header_blake3") != blake3.blake3(header.raw).hexdigest()
    ):
        raise DeltaError(f"{delta.name}: made against another file than the base {base.name}")
    names = sorted({k.removesuffix(GAP_SUFFIX) for k in keys if k.endswith(GAP_SUFFIX)})
    if sorted(keys) != sorted([n + GAP_SUFFIX for n in names] + [n + VALUE_SUFFIX for n in names]):
        raise DeltaError(f"{delta.name}: every tensor needs exactly one {GAP_SUFFIX} and one {VALUE_SUFFIX}")
    for name in names:
        if name not in header.tensors:
            raise DeltaError(f"{delta.name}: tensor {name!r} is not in the base file")
    return sorted(names, key=lambda n: header.tensors[n][1])


def _patch(d: Any, delta: Path, name: str, header: _Header) -> _Patch:
    """One tensor's entries, read and checked against its place in the base; DeltaError if they do not fit."""
    try:
        gaps, values = d.get_tensor(name + GAP_SUFFIX), d.get_tensor(name + VALUE_SUFFIX)
    except (TypeError, ValueError) as e:  # a dtype numpy has no type for (e.g. BF16)
        raise DeltaError(f"{delta.name}: the entry of {name!r} is not U8..U64 ({e})") from None
    dtype, begin, end = header.tensors[name]
    unit = _unit(dtype, end - begin)
    count = (end - begin) // unit.itemsize
    index = None
    if gaps.ndim == 1 and gaps.dtype == np.uint8 and values.ndim == 1 and values.dtype == unit:
        if np.count_nonzero(gaps) == len(values):
            index = _gap_index(gaps, count)
    if index is None:
        raise DeltaError(
            f"{delta.name}: the entry of {name!r} does not fit its tensor (U8 gaps ending in a nonzero byte, "
            f"indices below {count}, and as many values of {unit.itemsize} bytes)"
        )
    return header.data_start + begin, header.data_start + end, unit, index, values


def _chunks(size: int, patches: Iterable[_Patch]) -> Iterator[tuple[int, int, _Patch | None]]:
    """(offset, bytes, the patch whose elements it holds or None) covering a file of `size` bytes in order,
    CHUNK_BYTES at most; a chunk ends where a patched tensor begins or ends (patches in file order, apart:
    read_header refuses overlapping tensors)."""
    at = 0
    for patch in patches:
        begin, end = patch[0], patch[1]
        yield from ((c, min(CHUNK_BYTES, begin - c), None) for c in range(at, begin, CHUNK_BYTES))
        yield from ((c, min(CHUNK_BYTES, end - c), patch) for c in range(begin, end, CHUNK_BYTES))
        at = end
    yield from ((c, min(CHUNK_BYTES, size - c), None) for c in range(at, size, CHUNK_BYTES))


def _write_patched(src: int, dst: int, size: int, patches: Iterable[_Patch], hasher: Hasher | None) -> None:
    """The source's bytes into `dst` at the same offsets, each patch's elements set, each chunk fed to
    `hasher` in order while it is written."""
    buffers = (bytearray(CHUNK_BYTES), bytearray(CHUNK_BYTES))  # one is hashed while the other is filled
    with ThreadPoolExecutor(max_workers=1) as hashing:
        pending: Future[object] | None = None
        for turn, (at, n, patch) in enumerate(_chunks(size, patches)):
            view = memoryview(buffers[turn % 2])[:n]
            if os.preadv(src, [view], at) != n:
                raise _ShortSource
            if patch is not None:
                begin, _, unit, index, values = patch
                first = (at - begin) // unit.itemsize
                # bounds in the index's own dtype: mixed dtypes would cast the whole index on every chunk
                lo, hi = np.searchsorted(
                    index, np.array([first, first + n // unit.itemsize], dtype=index.dtype)
                )
                np.frombuffer(view, dtype=unit)[index[lo:hi] - first] = values[lo:hi]
            if pending is not None:
                pending.result()  # byte order; and the buffer the next chunk fills is free again
                pending = None
            if hasher is not None:
                pending = hashing.submit(hasher.update, view)
            _pwrite_all(dst, view, at)
        if pending is not None:
            pending.result()
