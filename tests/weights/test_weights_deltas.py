"""rlfleet/deltas.py, exactly: a delta rebuilds its target byte for byte for every element width a view
stores, lists exactly the changed elements, is not made where the file must be stored whole, and every
delta a store writer could plant that does not fit its base is refused (DeltaError), nothing written.

The files are safetensors files laid out as the views' writer lays them out (rlfleet/numerics/views.py
`safetensors_chunks`: sorted names, compact JSON header padded with spaces to 8 bytes, raw little-endian
data), written here from raw bytes so that every stored dtype (BF16, F8_E4M3, packed nvfp4 U8, ...) is
covered without torch, as the sampler's side applies them."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

from rlfleet import deltas
from rlfleet.deltas import (
    DELTA_FORMAT,
    ELEMENT_BYTES,
    GAP_SUFFIX,
    VALUE_SUFFIX,
    DeltaError,
    apply_delta,
    encode_delta,
)

Tensor = tuple[str, list[int], bytes]  # dtype, shape, raw bytes
Made = tuple[Path, Path, Path, dict[str, Tensor]]  # base, target, delta, the base's tensors

STORED_DTYPES = ["BF16", "F16", "F8_E4M3", "F8_E5M2", "U8", "I8", "BOOL", "F32", "I32", "U32", "I64", "F64"]
"""What views store: bf16 weights, fp8 codes, packed nvfp4 / mxfp4 bytes (U8), fp32 scales, integer buffers."""


def write_st(
    path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None, tail: bytes = b""
) -> Path:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(
        struct.pack("<Q", len(text)) + text + b"".join(tensors[n][2] for n in sorted(tensors)) + tail
    )
    return path


def random_tensor(rng: np.random.Generator, dtype: str, count: int) -> Tensor:
    return dtype, [count], rng.integers(0, 256, count * ELEMENT_BYTES[dtype], dtype=np.uint8).tobytes()


def changed(t: Tensor, positions: list[int], rng: np.random.Generator, *, byte: int = -1) -> Tensor:
    """`t` with each element at `positions` changed in one byte (`byte`: which byte of the element; -1 any)."""
    dtype, shape, raw = t
    width = ELEMENT_BYTES[dtype]
    data = bytearray(raw)
    for p in positions:
        k = int(rng.integers(0, width)) if byte < 0 else byte
        data[p * width + k] ^= int(rng.integers(1, 256))  # nonzero: the element differs
    return dtype, shape, bytes(data)


def read_delta(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(path), framework="numpy") as d:
        return {k: d.get_tensor(k) for k in d.keys()}, d.metadata()


def gap_code(indices: list[int]) -> bytes:
    """The gap coding of the module docstring, written plainly: per gap g (the first from -1), (g - 1) // 255
    bytes 0, then one byte (g - 1) % 255 + 1."""
    out, last = bytearray(), -1
    for i in indices:
        g, last = i - last, i
        out += bytes((g - 1) // 255) + bytes([(g - 1) % 255 + 1])
    return bytes(out)


def gap_decode(raw: bytes) -> list[int]:
    """Its inverse, written plainly: a 0 byte adds 255, a nonzero byte adds itself and ends an element."""
    out, at = [], -1
    for byte in raw:
        at += byte if byte else 255
        if byte:
            out.append(at)
    return out


# ------------------------------------------------------------------------------------------ round trip


@pytest.mark.parametrize("dtype", STORED_DTYPES)
def test_round_trip_is_bit_exact_for_every_stored_width(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    width = ELEMENT_BYTES[dtype]
    a = {"w": random_tensor(rng, dtype, 1000), "other": random_tensor(rng, "BF16", 64)}
    positions = [0, 7, 8, 500, 999]
    # the last byte of each element only: a byte-wise codec would list the same count, a wrong width
    # would misplace it; the element count is what the stored width makes it
    b = dict(a, w=changed(a["w"], positions, rng, byte=width - 1))
    base, target = write_st(tmp_path / "a.safetensors", a), write_st(tmp_path / "b.safetensors", b)
    stats = encode_delta(base, target, tmp_path / "d")
    assert stats is not None
    assert (stats.elements, stats.changed_elements, stats.tensors, stats.changed_tensors) == (1064, 5, 2, 1)
    assert stats.file_bytes == target.stat().st_size and stats.delta_bytes == (tmp_path / "d").stat().st_size
    entries, metadata = read_delta(tmp_path / "d")
    assert sorted(entries) == ["w" + GAP_SUFFIX, "w" + VALUE_SUFFIX]
    # gaps 1, 7, 1, 492, 499: the last two over 255, one 0 byte each
    assert entries["w" + GAP_SUFFIX].tobytes() == bytes([1, 7, 1, 0, 237, 0, 244]) == gap_code(positions)
    assert entries["w" + GAP_SUFFIX].dtype == np.uint8
    assert entries["w" + VALUE_SUFFIX].dtype == np.dtype(f"<u{width}")
    new_values = np.frombuffer(b["w"][2], dtype=f"<u{width}")[positions]
    assert entries["w" + VALUE_SUFFIX].tolist() == new_values.tolist()
    assert metadata["format"] == DELTA_FORMAT
    apply_delta(base, tmp_path / "d", tmp_path / "rebuilt")
    assert (tmp_path / "rebuilt").read_bytes() == target.read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".applying")] == []


def test_identical_files_give_an_empty_delta_that_rebuilds_the_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a = {"w": random_tensor(rng, "BF16", 300), "empty": ("F32", [0], b"")}
    base = write_st(tmp_path / "a", a)
    target = write_st(tmp_path / "b", a)
    stats = encode_delta(base, target, tmp_path / "d")
    assert stats is not None and (stats.changed_elements, stats.changed_tensors, stats.elements) == (
        0,
        0,
        300,
    )
    assert read_delta(tmp_path / "d")[0] == {}
    apply_delta(base, tmp_path / "d", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


@st.composite
def versions(draw: st.DrawFn) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, list[int]]]:
    """Two versions of one file: random tensors of random stored widths and the target with random
    elements changed (each in a random byte, to a random other value)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = draw(st.integers(1, 5))
    a: dict[str, Tensor] = {}
    b: dict[str, Tensor] = {}
    positions: dict[str, list[int]] = {}
    for i in range(n):
        dtype = draw(st.sampled_from(STORED_DTYPES))
        count = draw(st.integers(0, 200))
        name = f"model.layers.{i}.w"
        a[name] = random_tensor(rng, dtype, count)
        picked = sorted(draw(st.sets(st.integers(0, count - 1), max_size=count))) if count else []
        b[name] = changed(a[name], picked, rng)
        positions[name] = picked
    return a, b, positions


@settings(deadline=None)  # files and a hashing thread per example: a loaded box's timing is not under test
@given(versions())
def test_apply_of_encode_is_the_target_and_the_delta_lists_exactly_the_changed_elements(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[dict[str, Tensor], dict[str, Tensor], dict[str, list[int]]],
) -> None:
    a, b, positions = case
    tmp = tmp_path_factory.mktemp("prop")
    base, target = write_st(tmp / "a", a, {"format": "pt"}), write_st(tmp / "b", b, {"format": "pt"})
    stats = encode_delta(base, target, tmp / "d")
    assert stats is not None
    assert stats.changed_elements == sum(len(p) for p in positions.values())
    assert stats.elements == sum(len(t[2]) // ELEMENT_BYTES[t[0]] for t in a.values())
    entries, _ = read_delta(tmp / "d")
    listed = {k.removesuffix(GAP_SUFFIX): v.tobytes() for k, v in entries.items() if k.endswith(GAP_SUFFIX)}
    assert listed == {name: gap_code(p) for name, p in positions.items() if p}
    assert {name: gap_decode(raw) for name, raw in listed.items()} == {
        n: p for n, p in positions.items() if p
    }
    for name in listed:
        dtype, _, raw = b[name]
        expected = np.frombuffer(raw, dtype=f"<u{ELEMENT_BYTES[dtype]}")[positions[name]]
        assert entries[name + VALUE_SUFFIX].tobytes() == expected.tobytes()
    hasher = blake3.blake3()
    assert apply_delta(base, tmp / "d", tmp / "out", hasher=hasher) == target.stat().st_size
    assert (tmp / "out").read_bytes() == target.read_bytes()
    assert hasher.hexdigest() == blake3.blake3(target.read_bytes()).hexdigest()  # fed in the apply's pass


@pytest.mark.parametrize(("chunk_elements", "chunk_bytes"), [(1, 8), (3, 24), (64, 64)])
@pytest.mark.parametrize("copy_file_range", [True, False])
def test_round_trip_across_chunk_boundaries(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    chunk_elements: int,
    chunk_bytes: int,
    copy_file_range: bool,
) -> None:
    """Encode compares CHUNK_ELEMENTS at a time (a chunk's first gap continues from the previous chunk's last
    index), apply decodes GAP_DECODE_BYTES of gaps and sets CHUNK_BYTES at a time (set small here so that
    every tensor spans many chunks, and changes fall on both sides of each boundary), hashing each chunk in
    order while it is written; without copy_file_range (another OS) encode copies its blocks through a
    buffer."""
    monkeypatch.setattr(deltas, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(deltas, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(deltas, "GAP_DECODE_BYTES", chunk_elements)
    if not copy_file_range:
        monkeypatch.delattr(deltas.os, "copy_file_range")
    rng = np.random.default_rng(chunk_bytes)
    a = {
        "a.bf16": random_tensor(rng, "BF16", 300),
        "b.unchanged": random_tensor(rng, "F32", 50),
        "c.codes": random_tensor(rng, "U8", 333),
        "d.i64": random_tensor(rng, "I64", 40),
    }
    b = dict(
        a,
        **{
            "a.bf16": changed(a["a.bf16"], [0, 3, 4, 31, 32, 33, 299], rng),
            "c.codes": changed(a["c.codes"], [7, 8, 63, 64, 332], rng),
            "d.i64": changed(a["d.i64"], [0, 1, 2, 39], rng),
        },
    )
    base, target = write_st(tmp_path / "a", a), write_st(tmp_path / "b", b)
    stats = encode_delta(base, target, tmp_path / "d")
    assert stats is not None and (stats.changed_elements, stats.changed_tensors) == (16, 3)
    hasher = blake3.blake3()  # fed chunk by chunk from two alternating buffers, in a second thread
    apply_delta(base, tmp_path / "d", tmp_path / "out", hasher=hasher)
    assert (tmp_path / "out").read_bytes() == target.read_bytes()
    assert hasher.hexdigest() == blake3.blake3(target.read_bytes()).hexdigest()


GAPS = [1, 255, 256, 510, 511, 65536, 1, 255 * 300, 255 * 300 + 1]
"""One byte up to 255, then one 0 byte more per 255: 1 / 1 / 2 / 2 / 3 / 258 / 1 / 300 / 301 bytes."""


@pytest.mark.parametrize(("chunk_elements", "decode_bytes"), [(1 << 24, 1 << 20), (1000, 7), (65536, 1)])
def test_gap_coding_is_exact_for_gaps_at_and_far_above_each_byte_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_elements: int, decode_bytes: int
) -> None:
    """The exact bytes of gaps 1, 255, 256, 510, 511, 65536, 76500, 76501, and a last gap of ~900,000 (the
    last element of a 2^20-element tensor: 3,500+ 0 bytes), encoded CHUNK_ELEMENTS and decoded
    GAP_DECODE_BYTES at a time (a run of 0 bytes across decode blocks; a gap across compare chunks)."""
    monkeypatch.setattr(deltas, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(deltas, "GAP_DECODE_BYTES", decode_bytes)
    count = 1 << 20
    positions = [int(p) for p in np.cumsum(GAPS) - 1] + [count - 1]
    rng = np.random.default_rng(9)
    a = {"codes": random_tensor(rng, "U8", count), "scale": random_tensor(rng, "F32", 3)}
    b = dict(a, codes=changed(a["codes"], positions, rng), scale=changed(a["scale"], [2], rng))
    base, target = write_st(tmp_path / "a", a), write_st(tmp_path / "b", b)
    stats = encode_delta(base, target, tmp_path / "d")
    assert stats is not None and stats.changed_elements == len(positions) + 1
    entries, _ = read_delta(tmp_path / "d")
    raw = entries["codes" + GAP_SUFFIX].tobytes()
    expected = (
        b"\x01"
        + b"\xff"
        + b"\x00\x01"
        + b"\x00\xff"
        + b"\x00\x00\x01"
        + b"\x00" * 257
        + b"\x01"
        + b"\x01"
        + b"\x00" * 299
        + b"\xff"
        + b"\x00" * 300
        + b"\x01"
    )
    last_gap = count - 1 - positions[-2]
    assert raw == expected + b"\x00" * ((last_gap - 1) // 255) + bytes([(last_gap - 1) % 255 + 1])
    assert raw == gap_code(positions) and gap_decode(raw) == positions
    assert entries["scale" + GAP_SUFFIX].tobytes() == b"\x03"
    assert stats.delta_bytes - (tmp_path / "d").stat().st_size == 0
    apply_delta(base, tmp_path / "d", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == target.read_bytes()


def test_gap_coding_bytes_per_element_is_one_where_gaps_are_at_most_255(tmp_path: Path) -> None:
    """The size v2 is for: 1% of a bf16 tensor changed at random (mean gap 100), 1 + 0.99^255 / (1 - 0.99^255)
    = 1.08 gap bytes per changed element expected (v1: 4 bytes), and a tensor's 0 bytes never more than its
    elements / 255 (a sparse one)."""
    rng = np.random.default_rng(4)
    count = 1 << 16
    a = {"dense": random_tensor(rng, "BF16", count), "sparse": random_tensor(rng, "U8", count)}
    dense = sorted(int(p) for p in rng.choice(count, count // 100, replace=False))
    sparse = [0, count - 1]
    b = dict(a, dense=changed(a["dense"], dense, rng), sparse=changed(a["sparse"], sparse, rng))
    base, target = write_st(tmp_path / "a", a), write_st(tmp_path / "b", b)
    assert encode_delta(base, target, tmp_path / "d") is not None
    entries, _ = read_delta(tmp_path / "d")
    assert len(dense) <= len(entries["dense" + GAP_SUFFIX]) < 1.15 * len(dense)
    assert len(entries["sparse" + GAP_SUFFIX]) == 2 + (count - 2) // 255 <= 2 + count / 255


# ------------------------------------------------------------------------------------- stored whole


def _pair(tmp_path: Path) -> tuple[dict[str, Tensor], np.random.Generator]:
    rng = np.random.default_rng(7)
    return {"w": random_tensor(rng, "BF16", 256), "s": random_tensor(rng, "F32", 4)}, rng


@pytest.mark.parametrize(
    "change",
    ["dtype", "shape", "name", "metadata", "tensor added", "tail"],
)
def test_no_delta_between_files_of_other_headers_or_other_bytes_outside_the_tensors(
    tmp_path: Path, change: str
) -> None:
    a, rng = _pair(tmp_path)
    base = write_st(tmp_path / "a", a, {"format": "pt"}, tail=b"\0" * 8 if change == "tail" else b"")
    dtype, shape, raw = a["w"]
    b = dict(a)
    metadata, tail = {"format": "pt"}, b""
    if change == "dtype":
        b["w"] = ("F16", shape, raw)
    elif change == "shape":
        b["w"] = (dtype, [16, 16], raw)
    elif change == "name":
        b = {"w2": a["w"], "s": a["s"]}
    elif change == "metadata":
        metadata = {"format": "np"}
    elif change == "tensor added":
        b["x"] = random_tensor(rng, "U8", 8)
    else:  # same header and size, the data no tensor covers differs: a delta would lose it
        tail = b"\1" + b"\0" * 7
    target = write_st(tmp_path / "b", b, metadata, tail=tail)
    assert encode_delta(base, target, tmp_path / "d") is None
    assert not (tmp_path / "d").exists()


def test_no_delta_above_max_delta_bytes(tmp_path: Path) -> None:
    a, rng = _pair(tmp_path)
    b = dict(a, w=changed(a["w"], list(range(10)), rng), s=changed(a["s"], [3], rng))
    base, target = write_st(tmp_path / "a", a), write_st(tmp_path / "b", b)
    payload = 10 * (1 + 2) + 1 * (1 + 4)  # per element a gap byte (gaps 1..4) + its value in the stored width
    assert encode_delta(base, target, tmp_path / "d", max_delta_bytes=payload - 1) is None
    assert not (tmp_path / "d").exists()
    stats = encode_delta(base, target, tmp_path / "d", max_delta_bytes=payload)
    assert stats is not None and stats.changed_elements == 11


# ---------------------------------------------------------------------------------------- refused


@pytest.fixture
def made(tmp_path: Path) -> Made:
    """A base, its target and the delta between them (elements 1, 5, 9 of w and 0 of s changed)."""
    a, rng = _pair(tmp_path)
    b = dict(a, w=changed(a["w"], [1, 5, 9], rng), s=changed(a["s"], [0], rng))
    base, target = write_st(tmp_path / "a", a), write_st(tmp_path / "b", b)
    assert encode_delta(base, target, tmp_path / "d") is not None
    return base, target, tmp_path / "d", a


def plant(path: Path, entries: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> Path:
    save_file(dict(entries), str(path), metadata=dict(metadata))
    return path


def refused(base: Path, delta: Path, match: str | None) -> None:
    out = base.parent / "out"
    with pytest.raises(DeltaError, match=match):
        apply_delta(base, delta, out)
    assert not out.exists()
    assert [p.name for p in base.parent.iterdir() if p.name.endswith(".applying")] == []


def test_a_delta_applied_to_a_base_of_another_header_is_refused(tmp_path: Path, made: Made) -> None:
    base, _, delta, a = made
    other = write_st(tmp_path / "other", dict(a, w=("BF16", [16, 16], a["w"][2])))
    refused(other, delta, "made against another file")


def test_a_delta_applied_to_a_base_of_another_size_is_refused(tmp_path: Path, made: Made) -> None:
    base, _, delta, a = made
    longer = write_st(tmp_path / "longer", a, tail=b"\0" * 8)  # same header, 8 more bytes
    refused(longer, delta, "made against another file")


@pytest.mark.parametrize("field", ["format", "header_bytes", "file_bytes", "header_blake3"])
def test_a_delta_whose_metadata_names_another_format_or_base_is_refused(made: Made, field: str) -> None:
    base, _, delta, _ = made
    entries, metadata = read_delta(delta)
    metadata[field] = "rlfleet.delta/v0" if field == "format" else "0"
    planted = plant(delta.with_name("planted"), entries, metadata)
    refused(
        base, planted, "not an rlfleet.delta/v2 file" if field == "format" else "made against another file"
    )


def test_a_safetensors_file_without_metadata_is_refused(made: Made) -> None:
    base, _, delta, _ = made
    entries, _ = read_delta(delta)
    path = delta.with_name("bare")
    save_file(entries, str(path))
    refused(base, path, "not an rlfleet.delta/v2 file")


@pytest.mark.parametrize(
    "attack",
    [
        "gap past the tensor",
        "gap far past the tensor",
        "gap unfinished",
        "gap only zeros",
        "gaps fewer than values",
        "gaps more than values",
        "gap signed",
        "gap too wide",
        "gap 2-d",
        "value too narrow",
        "value too wide",
        "value signed",
        "value count",
        "missing val",
        "missing gap",
        "v1 index entry",
        "unknown entry",
        "tensor not in base",
    ],
)
def test_every_malformed_entry_is_refused(made: Made, attack: str) -> None:
    """The made delta's w entry codes indices 1, 5, 9 of w's 256 elements: gap bytes 2, 4, 4."""
    base, _, delta, _ = made
    entries, metadata = read_delta(delta)
    gap, val = "w" + GAP_SUFFIX, "w" + VALUE_SUFFIX
    assert entries[gap].tolist() == [2, 4, 4]
    if attack == "gap past the tensor":
        entries[gap] = np.array([2, 4, 251], dtype=np.uint8)  # indices 1, 5, 256: w has 256 elements
    elif attack == "gap far past the tensor":
        entries[gap] = np.array([2, 4] + [0] * 5000 + [4], dtype=np.uint8)
    elif attack == "gap unfinished":  # as many nonzero bytes as values, then a 0 that ends nothing
        entries[gap] = np.array([2, 4, 4, 0], dtype=np.uint8)
    elif attack == "gap only zeros":
        entries[gap] = np.zeros(3, dtype=np.uint8)
    elif attack == "gaps fewer than values":
        entries[gap] = np.array([2, 0, 4], dtype=np.uint8)  # one element (index 260 would be past, too)
    elif attack == "gaps more than values":
        entries[gap] = np.array([2, 4, 4, 1], dtype=np.uint8)
    elif attack == "gap signed":
        entries[gap] = entries[gap].astype(np.int8)
    elif attack == "gap too wide":  # v1's U32 indices under the v2 name
        entries[gap] = np.array([1, 5, 9], dtype=np.uint32)
    elif attack == "gap 2-d":
        entries[gap], entries[val] = entries[gap].reshape(1, 3), entries[val].reshape(1, 3)
    elif attack == "value too narrow":
        entries[val] = entries[val].astype(np.uint8)  # w is BF16: 2-byte values
    elif attack == "value too wide":
        entries[val] = entries[val].astype(np.uint32)
    elif attack == "value signed":
        entries[val] = entries[val].astype(np.int16)
    elif attack == "value count":
        entries[val] = entries[val][:2]
    elif attack == "missing val":
        del entries[val]
    elif attack == "missing gap":
        del entries[gap]
    elif attack == "v1 index entry":
        del entries[gap]
        entries["w:idx"] = np.array([1, 5, 9], dtype=np.uint32)
    elif attack == "unknown entry":
        entries["w:sum"] = np.zeros(1, dtype=np.uint8)
    else:
        entries["x" + GAP_SUFFIX] = np.array([1], dtype=np.uint8)
        entries["x" + VALUE_SUFFIX] = np.array([0], dtype=np.uint16)
    planted = plant(delta.with_name("planted"), entries, metadata)
    match = {
        "missing val": "exactly one",
        "missing gap": "exactly one",
        "v1 index entry": "exactly one",
        "unknown entry": "exactly one",
        "tensor not in base": "not in the base file",
    }.get(attack, "does not fit its tensor")
    refused(base, planted, match)


def test_a_gap_stream_may_end_on_the_tensors_last_element(made: Made) -> None:
    """The bound of the check above: index 255 of w's 256 elements (gap 250 from 5) is applied."""
    base, _, delta, a = made
    entries, metadata = read_delta(delta)
    entries["w" + GAP_SUFFIX] = np.array([2, 4, 250], dtype=np.uint8)
    planted = plant(delta.with_name("planted"), entries, metadata)
    apply_delta(base, planted, base.with_name("out"))
    rebuilt = np.frombuffer(base.with_name("out").read_bytes()[-256 * 2 :], dtype="<u2")  # w: the last tensor
    assert rebuilt[[1, 5, 255]].tolist() == entries["w" + VALUE_SUFFIX].tolist()


def test_a_v1_delta_is_refused_as_another_format(made: Made) -> None:
    """A delta of the previous format (U32 indices under :idx, format v1): refused, never read as v2."""
    base, _, delta, _ = made
    entries, metadata = read_delta(delta)
    v1 = {
        k.replace(GAP_SUFFIX, ":idx"): np.array(gap_decode(v.tobytes()), dtype=np.uint32)
        if k.endswith(GAP_SUFFIX)
        else v
        for k, v in entries.items()
    }
    planted = plant(delta.with_name("planted"), v1, dict(metadata, format="rlfleet.delta/v1"))
    refused(base, planted, "not an rlfleet.delta/v2 file")


def test_a_value_entry_of_a_dtype_numpy_lacks_is_refused(made: Made) -> None:
    """A :val stored as BF16 (numpy has no such type): refused as a DeltaError, not a TypeError."""
    base, _, delta, _ = made
    entries, metadata = read_delta(delta)
    planted = plant(delta.with_name("planted"), entries, metadata)
    raw = planted.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["w" + VALUE_SUFFIX]["dtype"] = "BF16"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    planted.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    refused(base, planted, "is not U8..U64")


@pytest.mark.parametrize("content", ["empty", "junk", "truncated", "header only"])
def test_a_delta_that_is_not_a_safetensors_file_is_refused(made: Made, content: str) -> None:
    base, _, delta, _ = made
    raw = delta.read_bytes()
    path = delta.with_name("planted")
    path.write_bytes(
        {
            "empty": b"",
            "junk": b"\x89PNG\r\n\x1a\n" + bytes(range(256)),
            "truncated": raw[: len(raw) - 3],
            "header only": raw[: 8 + struct.unpack("<Q", raw[:8])[0]],
        }[content]
    )
    refused(base, path, "not a readable safetensors file")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x07",
        b"\xff" * 8 + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 30) + b"{" + b" " * 29 + b"\0" * 4,
    ],
)
def test_a_base_or_target_that_is_not_a_safetensors_file_is_refused(made: Made, content: bytes) -> None:
    base, target, delta, _ = made
    bad = base.with_name("bad")
    bad.write_bytes(content)
    refused(bad, delta, None)
    with pytest.raises(DeltaError):
        encode_delta(bad, target, delta.with_name("d2"))
    with pytest.raises(DeltaError):
        encode_delta(base, bad, delta.with_name("d2"))
    assert not delta.with_name("d2").exists()


def test_a_tensor_outside_the_file_is_refused(tmp_path: Path, made: Made) -> None:
    base, target, delta, _ = made
    raw = base.read_bytes()
    bad = tmp_path / "short"
    bad.write_bytes(raw[: len(raw) - 1])  # the last tensor ends one byte past the file
    refused(bad, delta, "lies outside the file")
    with pytest.raises(DeltaError, match="lies outside the file"):
        encode_delta(bad, target, tmp_path / "d2")


def test_a_delta_applied_to_a_base_with_other_data_rebuilds_another_file(made: Made) -> None:
    """Same header and size, other data (a torn or wrong base): the codec cannot see it; the rebuilt file
    differs from the target, which the manifest's digest of the target then refuses (the caller's check)."""
    base, target, delta, a = made
    rng = np.random.default_rng(3)
    wrong = write_st(base.with_name("wrong"), dict(a, w=changed(a["w"], [100], rng)))
    apply_delta(wrong, delta, base.with_name("out"))
    assert base.with_name("out").read_bytes() != target.read_bytes()


def test_a_file_whose_tensors_overlap_is_refused(tmp_path: Path, made: Made) -> None:
    base, target, delta, _ = made
    header = {
        "x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "y": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    bad = tmp_path / "overlap"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + bytes(12))
    refused(bad, delta, "overlap")
    with pytest.raises(DeltaError, match="overlap"):
        encode_delta(bad, bad, tmp_path / "d2")
