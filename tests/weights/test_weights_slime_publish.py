"""`rlfleet slime bridge` (trainer/slime_bridge.py, rlfleet/slime_publish.py): slime's disk weight versions
(`weight_v{N:06d}/`, full or delta) published into a weight channel, against a stand-in that writes them as
slime's code does (tests/support/slime_publisher.py: slime itself cannot be installed here)."""

from __future__ import annotations

import json
import logging
import shutil
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
import zstandard
from safetensors.torch import load_file, save_file
from support.slime_publisher import INDEX, SlimeStandIn

from rlfleet.channel import WeightChannel
from rlfleet.numerics.views import load_view, read_view_tensors
from rlfleet.store import FilesystemStore
from rlfleet.trainer.metrics import PrometheusExporter
from rlfleet.trainer.publish.publisher import WeightPublisher
from rlfleet.trainer.slime_bridge import SlimeBridge, make_publisher

PUBLISHER_ID = "slime-bridge/test"


def bf16_view_equals(
    channel: WeightChannel, version: int, expected: dict[str, torch.Tensor], tmp: Path
) -> bool:
    got = channel.obtain_view(version, "bf16", tmp / f"obtained-v{version}")
    _, raw = read_view_tensors(got.directory)
    shutil.rmtree(got.directory)
    return set(raw) == set(expected) and all(
        raw[k].dtype == expected[k].dtype
        and raw[k].shape == expected[k].shape
        and torch.equal(raw[k].view(torch.int16), expected[k].view(torch.int16))
        for k in expected
    )


class Rig:
    def __init__(
        self, tmp: Path, base: Path, views: list[str], *, exporter: PrometheusExporter | None = None
    ):
        self.tmp, self.base, self.views = tmp, base, views
        self.slime = SlimeStandIn(tmp / "slime", base)
        self.exporter = exporter
        self.publisher = self.new_publisher()
        self.bridge = SlimeBridge(self.slime.publish_dir, self.publisher, base, exporter=exporter)

    @property
    def channel(self) -> WeightChannel:
        return self.publisher.channel

    def new_publisher(self) -> WeightPublisher:
        return make_publisher(
            str(self.tmp / "store"), self.views, self.base, keep_versions=50, publisher_id=PUBLISHER_ID
        )

    def restart(self) -> None:
        self.publisher.close()
        self.publisher = self.new_publisher()
        self.bridge = SlimeBridge(self.slime.publish_dir, self.publisher, self.base)

    def pointer(self) -> int:
        latest = self.channel.latest()
        assert latest is not None
        return latest.version

    def close(self) -> None:
        self.publisher.close()


@pytest.fixture
def rig_factory(tmp_path: Path, tiny_qwen3_dir: Path) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(views: list[str], **kw) -> Rig:
        rig = Rig(tmp_path, tiny_qwen3_dir, views, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


SCHEDULE = [  # (kind, encoding, checksum) for versions 1..20
    ("delta", "xor", "xxh3-128"),
    ("delta", "overwrite", "blake3"),
    ("delta", "xor", "adler32"),
    ("full", "", ""),
    ("delta", "overwrite", "xxh3-128"),
    ("delta", "xor", "blake3"),
    ("delta", "overwrite", "adler32"),
    ("full", "", ""),
    ("full", "", ""),
    ("delta", "xor", "xxh3-128"),
    ("delta", "xor", "xxh3-128"),
    ("delta", "overwrite", "blake3"),
    ("delta", "overwrite", "adler32"),
    ("full", "", ""),
    ("delta", "xor", "adler32"),
    ("delta", "overwrite", "xxh3-128"),
    ("delta", "xor", "blake3"),
    ("full", "", ""),
    ("delta", "overwrite", "blake3"),
    ("delta", "xor", "xxh3-128"),
]


def test_twenty_versions_full_and_delta_published_bit_exact(rig_factory, tmp_path: Path) -> None:
    exporter = PrometheusExporter(port=0)
    try:
        rig = rig_factory(["bf16", "fp8", "nvfp4"], exporter=exporter)
        rng = np.random.default_rng(43)
        published: list[int] = []
        for version, (kind, encoding, algorithm) in enumerate(SCHEDULE, start=1):
            rig.slime.publish(
                rig.slime.perturbed(rng),
                kind,
                encoding=encoding or "xor",
                checksum_format=algorithm or "xxh3-128",
            )
            if version % 3 in (0, 2):  # several versions pending at once, or one
                result = rig.bridge.poll()
                assert not result.refused, result.refused
                published += result.published
        published += rig.bridge.poll().published
        assert published == list(range(21))
        assert rig.channel.versions() == list(range(21)) and rig.pointer() == 20
        for version in range(21):
            assert bf16_view_equals(rig.channel, version, rig.slime.weights[version], tmp_path), version
        manifest = rig.channel.manifest(20)
        assert set(manifest.views) == {"bf16", "fp8", "nvfp4"}
        assert manifest.metadata["source"] == "slime" and manifest.metadata["slime_kind"] == "delta"
        for version in (14, 20):  # a full and a delta version: every view loads
            for view in ("fp8", "nvfp4"):
                got = rig.channel.obtain_view(version, view, tmp_path / f"{view}-{version}")
                name, state = load_view(got.directory)
                assert name == view and set(state) == set(rig.slime.weights[version])
                assert all(torch.isfinite(t).all() for t in state.values())
        # what the operator scrapes: the trainer's step and weight version are the version published
        from rlfleet.operator.trainer_report import parse_trainer_report

        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics").read().decode()
        report = parse_trainer_report(text)
        assert report.weight_version == 20 and report.step == 20 and report.external_version == 20
        assert 'rlfleet_trainer_weights_view_bytes{view="nvfp4"}' in text
        # slime writing version 21 (its index not there yet): slime's newest is 21, the channel's still 20
        (rig.slime.publish_dir / "weight_v000021").mkdir()
        assert rig.bridge.poll().refused
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics").read().decode()
        report = parse_trainer_report(text)
        assert (report.weight_version, report.external_version) == (20, 21)
        from rlfleet.operator.trainer_report import trainer_job_status

        status = trainer_job_status({"spec": {}}, [], report, "2026-12-07T00:00:00Z").status
        assert (status["weightVersion"], status["externalVersion"]) == (20, 21)
    finally:
        exporter.close()


# ------------------------------------------------------------------------------------------ attacks
def _first_file(vdir: Path) -> Path:
    index = json.loads((vdir / INDEX).read_text())
    return vdir / sorted(set(index["weight_map"].values()))[0]


def _rewrite_delta_payload(vdir: Path, change: Callable[[bytes], bytes]) -> None:
    """Re-encode the first tensor of the first delta file with `change` applied to its decompressed diff."""
    path = _first_file(vdir)
    data = path.read_bytes()
    tensors = safetensors.numpy.load(data)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(n))["__metadata__"]
    name = sorted(tensors)[0]
    diff = zstandard.ZstdDecompressor().decompress(tensors[name].tobytes())
    tensors[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(change(diff)), dtype=np.uint8)
    path.write_bytes(safetensors.numpy.save(tensors, metadata=metadata))


def _edit_index(vdir: Path, **metadata: str) -> None:
    index = json.loads((vdir / INDEX).read_text())
    index["metadata"].update(metadata)
    (vdir / INDEX).write_text(json.dumps(index))


def _flip_bit(diff: bytes) -> bytes:
    b = bytearray(diff)
    b[-1] ^= 0x01
    return bytes(b)


def attack_index_missing(s: SlimeStandIn, v: int) -> str:
    (s.write(v, "delta") / INDEX).unlink()
    return "incomplete: no model.safetensors.index.json"


def attack_delta_file_missing(s: SlimeStandIn, v: int) -> str:
    _first_file(s.write(v, "delta")).unlink()
    return "is missing"


def attack_full_file_missing(s: SlimeStandIn, v: int) -> str:
    _first_file(s.write(v, "full")).unlink()
    return "is missing"


def attack_flipped_byte(s: SlimeStandIn, v: int) -> str:
    _rewrite_delta_payload(s.write(v, "delta", encoding="xor", checksum_format="xxh3-128"), _flip_bit)
    return "xxh3-128 checksum mismatch for 1 tensor(s)"


def attack_flipped_byte_overwrite(s: SlimeStandIn, v: int) -> str:
    _rewrite_delta_payload(s.write(v, "delta", encoding="overwrite", checksum_format="adler32"), _flip_bit)
    return "adler32 checksum mismatch"


def attack_flipped_stored_byte(s: SlimeStandIn, v: int) -> str:
    path = _first_file(s.write(v, "delta"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's compressed bytes
    path.write_bytes(bytes(data))
    return "weight_v000003"


def attack_wrong_base_version(s: SlimeStandIn, v: int) -> str:
    _edit_index(s.write(v, "delta"), base_version=f"{v - 2:06d}")
    return "base_version 000001"


def attack_version_mismatch(s: SlimeStandIn, v: int) -> str:
    _edit_index(s.write(v, "delta"), version=f"{v + 4:06d}")
    return "index says version 000007, the directory is version 3"


def attack_path_escape(s: SlimeStandIn, v: int) -> str:
    vdir = s.write(v, "delta")
    first = _first_file(vdir)
    shutil.move(first, vdir.parent / "escape.safetensors")
    index = json.loads((vdir / INDEX).read_text())
    index["weight_map"] = {
        k: ("../escape.safetensors" if f == first.name else f) for k, f in index["weight_map"].items()
    }
    (vdir / INDEX).write_text(json.dumps(index))
    return "is not inside the version directory"


def attack_symlink_escape(s: SlimeStandIn, v: int) -> str:
    vdir = s.write(v, "delta")
    first = _first_file(vdir)
    outside = vdir.parent / "outside.safetensors"
    shutil.move(first, outside)
    first.symlink_to(outside)
    return "leads outside the version directory"


def attack_shape_change_full(s: SlimeStandIn, v: int) -> str:
    vdir = s.write(v, "full")
    path = _first_file(vdir)
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = torch.cat([tensors[name].reshape(-1), tensors[name].reshape(-1)[:2]])
    save_file(tensors, str(path), metadata={"format": "pt"})
    return "a shape or dtype change is not a weight update"


def attack_shape_change_delta(s: SlimeStandIn, v: int) -> str:
    _rewrite_delta_payload(s.write(v, "delta", encoding="xor"), lambda d: d + bytes(256))
    return "a shape change is not a weight update"


def attack_unknown_encoding(s: SlimeStandIn, v: int) -> str:
    _edit_index(s.write(v, "delta"), delta_encoding="rle")
    return "unknown delta_encoding 'rle'; supported:"


def attack_newer_layout(s: SlimeStandIn, v: int) -> str:
    vdir = s.version_dir(v)
    vdir.mkdir(parents=True)
    save = {"__positions__": np.zeros(8, np.uint8), "__values__": np.zeros(4, np.uint8)}
    (vdir / "model-00000-of-00001.safetensors").write_bytes(
        safetensors.numpy.save(save, metadata={"encoding": "deltas_zstd"})
    )
    (vdir / "DONE").write_text("")
    return "newer delta wire layout"


def attack_newer_layout_index(s: SlimeStandIn, v: int) -> str:
    _edit_index(s.write(v, "delta"), delta_encoding="deltas_zstd")
    return "newer delta wire layout (encoding 'deltas_zstd') is not supported; supported: full HF checkpoints"


ATTACKS = [
    attack_index_missing,
    attack_delta_file_missing,
    attack_full_file_missing,
    attack_flipped_byte,
    attack_flipped_byte_overwrite,
    attack_flipped_stored_byte,
    attack_wrong_base_version,
    attack_version_mismatch,
    attack_path_escape,
    attack_symlink_escape,
    attack_shape_change_full,
    attack_shape_change_delta,
    attack_unknown_encoding,
    attack_newer_layout,
    attack_newer_layout_index,
]


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.__name__.removeprefix("attack_"))
def test_attack_refused_with_one_line_then_next_good_version_published(
    attack, rig_factory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = rig_factory(["bf16"])
    rng = np.random.default_rng(7)
    rig.slime.publish(rig.slime.perturbed(rng), "delta", encoding="xor")
    rig.slime.publish(rig.slime.perturbed(rng), "full")
    assert rig.bridge.poll().published == [0, 1, 2]
    before = rig.channel.versions()

    assert rig.slime.stage(rig.slime.perturbed(rng)) == 3  # version 3's weights; the attack in its directory
    expected = attack(rig.slime, 3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.slime_bridge"):
        for _ in range(2):  # refused at every poll, logged once
            result = rig.bridge.poll()
            assert result.published == [] and list(result.refused) == [3]
    line = result.refused[3]
    assert expected in line and "\n" not in line and line.startswith("weight_v000003"), line
    assert [r.getMessage() for r in caplog.records] == [f"v3 not published: {line}"]
    assert rig.channel.versions() == before and rig.pointer() == 2

    # slime (re)writes version 3 whole: published, bit-exact, then the stream goes on
    shutil.rmtree(rig.slime.version_dir(3))
    rig.slime.write(3, "delta", encoding="overwrite", checksum_format="blake3")
    rig.slime.publish(rig.slime.perturbed(rng), "delta", encoding="xor")
    assert rig.bridge.poll().published == [3, 4]
    for version in (3, 4):
        assert bf16_view_equals(rig.channel, version, rig.slime.weights[version], tmp_path)


def test_refused_version_blocks_later_deltas_not_a_later_full(rig_factory, tmp_path: Path) -> None:
    rig = rig_factory(["bf16"])
    rng = np.random.default_rng(11)
    s = rig.slime
    s.publish(s.perturbed(rng), "delta")
    assert rig.bridge.poll().published == [0, 1]
    (s.publish(s.perturbed(rng), "delta") / INDEX).rename(s.version_dir(2) / "index.later")  # v2 partial
    s.publish(s.perturbed(rng), "delta")  # v3 applies to v2: waits for it
    result = rig.bridge.poll()
    assert result.published == [] and sorted(result.refused) == [2, 3]
    assert "delta on v2, which is not published" in result.refused[3]
    (s.version_dir(2) / "index.later").rename(s.version_dir(2) / INDEX)  # v2 completes
    assert rig.bridge.poll().published == [2, 3]

    (s.publish(s.perturbed(rng), "delta") / INDEX).unlink()  # v4 never completes
    s.publish(s.perturbed(rng), "full")  # v5 needs no history
    s.publish(s.perturbed(rng), "delta", encoding="overwrite")
    result = rig.bridge.poll()
    assert result.published == [5, 6] and list(result.refused) == [4]
    s.write(4, "delta")  # v4 completes too late: below the pointer, never published
    assert rig.bridge.poll().published == [] and rig.channel.versions() == [0, 1, 2, 3, 5, 6]
    for version in (2, 3, 5, 6):
        assert bf16_view_equals(rig.channel, version, s.weights[version], tmp_path)


@pytest.mark.parametrize("stream", ["full_then_deltas", "deltas_from_base", "chain_broken"])
def test_restarted_bridge_continues_from_the_pointer(
    stream: str, rig_factory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarted bridge rebuilds its copy of the pointer's version from slime's directory (the newest full
    version at or below it, or the base, then the deltas), never from the channel."""
    rig = rig_factory(["bf16", "fp8"])
    rng = np.random.default_rng(5)
    s = rig.slime
    kinds = (
        ["delta"] * 6
        if stream == "deltas_from_base"
        else ["delta", "delta", "full", "delta", "delta", "delta"]
    )
    for i, kind in enumerate(kinds):
        s.publish(s.perturbed(rng), kind, encoding=("xor", "overwrite")[i % 2], checksum_format="blake3")
    assert rig.bridge.poll().published == list(range(7))
    rig.restart()
    s.publish(s.perturbed(rng), "delta", encoding="overwrite")
    s.publish(s.perturbed(rng), "delta", encoding="xor")
    if stream == "chain_broken":
        shutil.rmtree(s.version_dir(4))
        result = rig.bridge.poll()
        assert result.published == [] and sorted(result.refused) == [7, 8]
        assert "weight_v000004: needed to rebuild" in result.refused[7] and "\n" not in result.refused[7]
        s.publish(s.perturbed(rng), "full")
        assert rig.bridge.poll().published == [9]
        s.publish(s.perturbed(rng), "delta")
        assert rig.bridge.poll().published == [10]
        assert bf16_view_equals(rig.channel, 10, s.weights[10], tmp_path)
        return
    with caplog.at_level(logging.INFO, logger="rlfleet.trainer.slime_bridge"):
        assert rig.bridge.poll().published == [7, 8]
    seed = (
        "the base checkpoint + 6 delta(s)" if stream == "deltas_from_base" else "weight_v000003 + 3 delta(s)"
    )
    assert f"rebuilt v6 from {seed}" in caplog.text
    assert rig.bridge.poll().published == []  # never twice
    for version in (7, 8):
        assert bf16_view_equals(rig.channel, version, s.weights[version], tmp_path)


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_once_publishes_and_bad_input_is_one_line(
    tmp_path: Path, tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    from rlfleet.cli import main

    s = SlimeStandIn(tmp_path / "slime", tiny_qwen3_dir)
    rng = np.random.default_rng(3)
    s.publish(s.perturbed(rng), "delta", encoding="overwrite", checksum_format="adler32")
    s.publish(s.perturbed(rng), "full")
    store = tmp_path / "store"
    common = [
        "slime",
        "bridge",
        "--publish-dir",
        str(s.publish_dir),
        "--store",
        str(store),
        "--base-checkpoint",
        str(tiny_qwen3_dir),
        "--metrics-port",
        "0",
    ]
    args = [*common, "--views", "bf16,fp8", "--once"]
    assert main(args) == 0
    channel = WeightChannel(FilesystemStore(store))
    assert channel.versions() == [0, 1, 2]
    assert bf16_view_equals(channel, 2, s.weights[2], tmp_path)

    (s.publish(s.perturbed(rng), "delta") / INDEX).unlink()
    assert main(args) == 1  # refused: exit 1 with --once, nothing published
    assert channel.versions() == [0, 1, 2]

    capsys.readouterr()
    for bad, says in [
        (["--views", "bf16,int3"], "unknown view 'int3'"),
        (["--base-checkpoint", str(tmp_path)], "is not an HF checkpoint directory"),
        (["--poll-interval", "0"], "--poll-interval must be > 0"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main([*args[:-1], *bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err

    taken = tmp_path / "taken"  # a channel another writer holds
    other = WeightPublisher(
        FilesystemStore(taken, create=True),
        views=["bf16"],
        publisher_id="someone-else",
        writer_lease_ttl_seconds=600,
    )
    common[common.index("--store") + 1] = str(taken)
    try:
        assert main([*common, "--views", "bf16", "--publisher-id", "another-bridge", "--once"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "someone-else" in err[0], err
    finally:
        other.close()


def test_the_bridge_pod_reads_its_job_from_the_config(
    tmp_path: Path, tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`rlfleet slime bridge --config <the job's RLJob>` (the operator's command, examples/rljob-slime.yaml
    with this machine's paths): the publish dir, the store, the model source (builtin:tiny-qwen3 built into
    the model cache: the same bytes as the stand-in's base), the views of the job's three groups, its
    weightChannel.deltas and the trainer's publisher id come from the RLJob. An RLJob without trainer.external is one line, exit 2."""
    import yaml

    from rlfleet.cli import main

    monkeypatch.setenv("RLFLEET_MODEL_CACHE", str(tmp_path / "models"))
    example = Path(__file__).resolve().parents[2] / "examples" / "rljob-slime.yaml"
    job = next(d for d in yaml.safe_load_all(example.read_text()) if d["kind"] == "RLJob")
    job["spec"]["trainer"]["external"]["publishDir"] = str(tmp_path / "slime")
    job["spec"]["trainer"]["volumeMounts"][0]["mountPath"] = str(tmp_path)
    job["spec"]["weightChannel"]["store"]["path"] = str(tmp_path / "store")
    job["spec"]["weightChannel"]["deltas"] = {"anchorEvery": 1}  # every version whole: not the default
    config = tmp_path / "rljob.yaml"
    config.write_text(yaml.safe_dump(job))
    s = SlimeStandIn(tmp_path / "slime", tiny_qwen3_dir)
    s.publish(s.perturbed(np.random.default_rng(5)), "delta", encoding="xor", checksum_format="blake3")
    assert main(["slime", "bridge", "--config", str(config), "--metrics-port", "0", "--once"]) == 0
    channel = WeightChannel(FilesystemStore(tmp_path / "store"))
    assert channel.versions() == [0, 1]
    manifest = channel.manifest(1)
    assert sorted(manifest.views) == ["bf16", "fp8", "nvfp4"]
    assert manifest.publisher == "trainer/default/slime"
    assert all(vm.delta is None for vm in manifest.views.values())  # the job's anchorEvery 1, not 16
    assert bf16_view_equals(channel, 1, s.weights[1], tmp_path)

    del job["spec"]["trainer"]["external"]
    config.write_text(yaml.safe_dump(job))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["slime", "bridge", "--config", str(config), "--once"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "has no trainer.external" in err and err.count("\n") == 1
