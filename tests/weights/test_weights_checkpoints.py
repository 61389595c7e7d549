"""Checkpoints next to the weight channel, as an adversary and a fenced trainer would meet them
(trainer/publish/checkpoint.py), on every store kind (filesystem, S3 with conditional writes, S3 lock-free: moto's
real server) and on a checkpoint directory (local mode, a filesystem channel's `checkpoints/`).

1. Names are names: `latest` is data from the store; an entry that is not exactly a name the trainer
   writes (an absolute path, `..`, a directory part, a symbolic link in the directory) is a damaged entry,
   refused with its reason, and the files those names point at survive, unread and unchanged.
2. Fenced like publishes: a trainer whose writer lease was taken over writes nothing; one that passed its
   lease check just before (paused there) never replaces the holder's file of the same step, cannot name
   an older checkpoint the newest, and deletes none of the holder's files."""

from __future__ import annotations

import json
import logging
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlfleet.channel import LeaseLostError
from rlfleet.store import FilesystemStore, S3Store, Store
from rlfleet.trainer.publish import checkpoint
from rlfleet.trainer.publish.checkpoint import CheckpointError, WriterFence

ATTACKS = ("{victim}", "../../victim", "ckpt-00000001.pt/../../x", "/", "", ".", "ckpt-00000001.pt\n",
           "ckpt-1.pt", "ckpt-00000001-g0.pt", "ckpt-00000001-g01.pt", "ckpt-０００００００１.pt", 7, None)  # fmt: skip


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def holding(generation: int) -> WriterFence:
    return WriterFence(generation, lambda: None)  # the lease is (still) this writer's


def taken_over(generation: int) -> WriterFence:
    def check() -> None:
        raise LeaseLostError(f"the writer lease (generation {generation}) was taken over")

    return WriterFence(generation, check)


def latest_of(target: Path | Store) -> dict:
    store, prefix = (target, "checkpoints/") if isinstance(target, Store) else (FilesystemStore(target), "")
    value = store.read_pointer(prefix + "latest")
    assert value is not None
    return json.loads(value.data)


def write_latest(target: Path | Store, document: dict) -> None:
    store, prefix = (target, "checkpoints/") if isinstance(target, Store) else (FilesystemStore(target), "")
    current = store.read_pointer(prefix + "latest")
    assert store.compare_and_swap(
        prefix + "latest", None if current is None else current.token, json.dumps(document).encode()
    )


def listed(target: Path | Store) -> list[str]:
    """The checkpoint files there (`latest` is a swapped key: a log of entries on a lock-free S3 store)."""
    if isinstance(target, Store):
        names = [k.removeprefix("checkpoints/") for k in target.list("checkpoints/")]
    else:
        names = [p.name for p in target.iterdir()]
    return sorted(n for n in names if n.startswith("ckpt-"))


@pytest.fixture(params=["directory", "filesystem", "s3-conditional", "s3-lock-free"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path | Store]:
    """A checkpoint directory, or a channel's store (checkpoints/ under it), as conftest's `any_store`."""
    if request.param == "directory":
        yield tmp_path / "checkpoints"
        return
    if request.param == "filesystem":
        yield FilesystemStore(tmp_path / "store", create=True)
        return
    import boto3

    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"ck-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    store = S3Store(
        bucket,
        "channel",
        endpoint_url=endpoint,
        conditional_writes=None if request.param == "s3-conditional" else False,
    )
    assert store.conditional_writes == (request.param == "s3-conditional")
    yield store
    store.close()


def test_names_in_latest_are_names_never_paths(
    target: Path | Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`latest` lists (newest first) an absolute path, `..` walks out of the resume's temporary directory,
    a name with a directory part, other spellings and non-strings, each with a digest; the good step-1
    checkpoint is the oldest. Every crafted entry is refused with its reason, step 1 resumes, and the files
    the crafted names point at (wherever the temporary directory is) are still there, unchanged."""
    checkpoint.save_checkpoint(target, state(1))
    staging = target.staging_dir() if isinstance(target, Store) else None
    if staging is None:  # the system's: put it where this test can plant victims around it
        (tmp_path / "sys" / "tmp").mkdir(parents=True)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "sys" / "tmp"))
        staging = tmp_path / "sys" / "tmp"
    victims = {
        tmp_path / "abs-victim": b"absolute",
        staging.parent / "victim": b"dot-dot",
        staging / "x": b"inside",
    }
    for path, data in victims.items():
        path.write_bytes(data)
    good = latest_of(target)["checkpoints"]
    digest = good[0]["digest"]
    crafted = [
        {
            "name": a.format(victim=tmp_path / "abs-victim") if isinstance(a, str) else a,
            "digest": digest,
            "bytes": 8,
        }
        for a in ATTACKS
    ]
    write_latest(target, {"checkpoints": good + crafted})  # newest last: every attack is tried before step 1
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.publish.checkpoint"):
        resumed = checkpoint.load_latest(target)
    assert resumed is not None and resumed["step"] == 1
    for path, data in victims.items():
        assert path.read_bytes() == data, path
    refusals = [
        r.getMessage() for r in caplog.records if "not a checkpoint name the trainer writes" in r.getMessage()
    ]
    assert len(refusals) == len(ATTACKS)
    assert any(str(tmp_path / "abs-victim") in m for m in refusals) and any(
        "../../victim" in m for m in refusals
    )

    # none good: the resume fails naming every refusal, and still touches nothing
    write_latest(target, {"checkpoints": crafted})
    with pytest.raises(
        CheckpointError, match=r"no checkpoint in .* could be loaded: '.*abs-victim' is not a checkpoint name"
    ):
        checkpoint.load_latest(target)
    for path, data in victims.items():
        assert path.read_bytes() == data, path


def test_a_symbolic_link_in_the_checkpoint_directory_is_refused_and_its_target_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory's newest checkpoint is a link to another file (with that file's digest in `latest`,
    as a writer of the volume could record): refused as a link, not read, the previous one resumes; the
    next save deletes the link, never its target."""
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        checkpoint.save_checkpoint(directory, state(step))
    victim = tmp_path / "victim.pt"
    (directory / "ckpt-00000002.pt").replace(victim)  # a real checkpoint's bytes: its digest matches
    (directory / "ckpt-00000002.pt").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="rlfleet.trainer.publish.checkpoint"):
        resumed = checkpoint.load_latest(directory)
    assert resumed is not None and resumed["step"] == 1
    assert any(
        "ckpt-00000002.pt" in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records
    )
    before = victim.read_bytes()
    for step in (2, 3, 4):  # the resumed run saves on: the link is replaced, then dropped
        checkpoint.save_checkpoint(directory, state(step))
    assert victim.read_bytes() == before
    assert listed(directory) == ["ckpt-00000003.pt", "ckpt-00000004.pt"]


def test_a_fenced_writer_writes_no_checkpoint(target: Path | Store) -> None:
    """The lease was taken over before the checkpoint: LeaseLostError, and nothing is written."""
    checkpoint.save_checkpoint(target, state(1), fence=holding(1))
    before = (listed(target), latest_of(target))
    with pytest.raises(LeaseLostError, match="taken over"):
        checkpoint.save_checkpoint(target, state(2), fence=taken_over(1))
    assert (listed(target), latest_of(target)) == before


def test_a_writer_paused_past_its_lease_check_changes_nothing_of_the_new_holder(target: Path | Store) -> None:
    """Generation 1 wrote steps 1-2; generation 2 (the lease's new holder, resumed from step 2) wrote step
    3. Generation 1, paused just after its lease check, now saves step 3 too: its file has its own name
    (never the holder's), `latest` refuses it (a newer generation wrote it), so the holder's list, files
    and bytes stay; the holder's next save deletes the fenced writer's leftover."""
    for step in (1, 2):
        checkpoint.save_checkpoint(target, state(step), fence=holding(1))
    checkpoint.save_checkpoint(target, {**state(3), "by": "holder"}, fence=holding(2))
    before = latest_of(target)
    assert before["lease_generation"] == 2
    assert [e["name"] for e in before["checkpoints"]] == ["ckpt-00000002-g1.pt", "ckpt-00000003-g2.pt"]
    with pytest.raises(LeaseLostError, match="generation 2; this trainer holds generation 1"):
        checkpoint.save_checkpoint(target, {**state(3), "by": "fenced"}, fence=holding(1))
    with pytest.raises(LeaseLostError):  # an older step, as a fenced trainer further behind would save
        checkpoint.save_checkpoint(target, state(1), fence=holding(1))
    assert latest_of(target) == before
    assert checkpoint.load_latest(target)["by"] == "holder"  # type: ignore[index]
    assert "ckpt-00000003-g1.pt" in listed(target)  # written before its `latest` was refused
    checkpoint.save_checkpoint(target, state(4), fence=holding(2))
    assert listed(target) == ["ckpt-00000003-g2.pt", "ckpt-00000004-g2.pt"]


def test_latest_never_names_a_lower_step_newest_and_a_newer_generation_drops_what_it_did_not_resume(
    target: Path | Store,
) -> None:
    """One writer cannot rewind `latest` (a lower step than it named: refused, nothing changes); a new
    lease generation resumed from an older checkpoint (the newer ones damaged) names its step newest and
    drops the older generation's entries of that step and above."""
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(target, state(step), fence=holding(1))
    before = (listed(target), latest_of(target))
    with pytest.raises(
        CheckpointError, match="refusing to name step 2 the newest checkpoint .* it names step 3"
    ):
        checkpoint.save_checkpoint(target, state(2), fence=holding(1))
    assert latest_of(target) == before[1]
    checkpoint.save_checkpoint(target, state(2), fence=holding(2))  # resumed from step 1 (2 and 3 refused)
    assert [e["name"] for e in latest_of(target)["checkpoints"]] == ["ckpt-00000002-g2.pt"]
    assert listed(target) == ["ckpt-00000002-g2.pt"]
