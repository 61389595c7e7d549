"""Experiment tracking (trainer/tracking.py): the spec / RLFLEET_TRACKING factory, its clear errors,
the fan-out, and each backend for real: metrics written through `open_tracker` are read back with the
library's own reader (TensorBoard's EventAccumulator on the event files; MLflow's client on a local file
store; W&B's offline transaction log decoded with W&B's own protobuf records). The three packages are
in the `dev` extra (scripts/bootstrap test), so these tests never skip: a missing one fails here.
`run_training`'s use of the tracker, on in-process samplers: tests/trainer/test_trainer_run_tracking.py."""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.trainer.tracking import KINDS, MultiTracker, TrackingError, open_tracker, parse_spec

# one step as the trainer logs it: flat keys, a per-group key with "/", and a non-finite value to drop
STEP_1 = {"kl_k3": 0.25, "group/h100-fp8/oor_share": 0.5, "bad": float("nan")}
STEP_2 = {"kl_k3": 0.5}


def test_no_spec_tracks_nothing() -> None:
    assert open_tracker(env={}).trackers == []
    assert (
        open_tracker("", env={"RLFLEET_TRACKING": "tensorboard:/x"}).trackers == []
    )  # an explicit spec wins


def test_parse_spec() -> None:
    assert parse_spec("tensorboard:/tmp/tb, wandb:proj,mlflow:file:///tmp/ml") == [
        ("tensorboard", "/tmp/tb"),
        ("wandb", "proj"),
        ("mlflow", "file:///tmp/ml"),
    ]
    with pytest.raises(TrackingError, match="unknown kind 'neptune'"):
        parse_spec("neptune:x")
    with pytest.raises(TrackingError, match=r"expected tensorboard:<DIR>"):
        parse_spec("tensorboard")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_missing_package_is_a_clear_error_naming_the_extra(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, extra = KINDS[kind]
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    with pytest.raises(TrackingError) as err:
        open_tracker(env={"RLFLEET_TRACKING": f"tensorboard:{tmp_path / 'tb'},{kind}:{tmp_path}"})
    assert f"the {module!r} package is not installed: pip install 'rlfleet[{extra}]'" in str(err.value)
    assert not (tmp_path / "tb").exists()  # every package is checked before any tracker is opened


def test_multi_tracker_fans_out_and_closes() -> None:
    class Recording:
        def __init__(self) -> None:
            self.logged: list = []
            self.closed = False

        def log(self, step, metrics):
            self.logged.append((step, dict(metrics)))

        def close(self):
            self.closed = True

    a, b = Recording(), Recording()
    multi = MultiTracker([a, b])
    multi.log(3, {"kl_k3": 0.5})
    multi.close()
    assert a.logged == b.logged == [(3, {"kl_k3": 0.5})] and a.closed and b.closed


def test_tensorboard_writes_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = open_tracker(f"tensorboard:{tmp_path}", env={})
    tracker.log(1, STEP_1)
    tracker.log(2, STEP_2)
    tracker.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["group/h100-fp8/oor_share", "kl_k3"]  # "bad" (NaN) dropped
    assert [(e.step, e.value) for e in acc.Scalars("kl_k3")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("group/h100-fp8/oor_share")] == [(1, 0.5)]


def test_mlflow_local_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses the file store otherwise
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "rlfleet-test")
    store = tmp_path.as_uri()
    tracker = open_tracker(f"mlflow:{store}", run_name="job-a", env={})
    tracker.log(1, STEP_1)
    tracker.log(2, STEP_2)
    run_id = tracker.trackers[0].run_id
    tracker.close()
    client = mlflow.MlflowClient(tracking_uri=store)
    run = client.get_run(run_id)
    assert (run.info.run_name, run.info.status) == ("job-a", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "rlfleet-test"
    assert sorted(run.data.metrics) == ["group/h100-fp8/oor_share", "kl_k3"]  # "bad" (NaN) dropped
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "kl_k3")] == [(1, 0.25), (2, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "group/h100-fp8/oor_share")] == [
        (1, 0.5)
    ]
    # a second run of the same experiment reuses it
    again = open_tracker(f"mlflow:{store}", env={})
    again.close()
    assert client.get_run(again.trackers[0].run_id).info.experiment_id == run.info.experiment_id


def test_mlflow_uri_refused_by_mlflow_is_a_start_up_error(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match=r"^tracking 'mlflow:nosuch://x': .*unsupported URI 'nosuch://x'"):
        open_tracker("mlflow:nosuch://x", env={})


# W&B 0.31 ships no Python reader of its transaction log (the `.wandb` file; wandb-core, in Go, writes
# it): it is LevelDB's log format (32 KiB blocks of CRC-checked chunks) behind a 7-byte W&B header,
# each record one of W&B's own protobuf `Record`s (wandb.proto.wandb_internal_pb2).
WANDB_LOG_BLOCK = 32768
WANDB_CHUNK_HEADER = struct.Struct("<IHB")  # crc32 of type byte + data, data length, chunk type
WANDB_LAST_CHUNKS = (1, 4)  # FULL, LAST: a record ends; FIRST (2) and MIDDLE (3) continue it


def wandb_records(path: Path) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if len(data) < 7:
        return  # the header is not written yet
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    pos, record = 7, b""
    while pos + WANDB_CHUNK_HEADER.size <= len(data):
        room = WANDB_LOG_BLOCK - pos % WANDB_LOG_BLOCK
        if room < WANDB_CHUNK_HEADER.size:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        crc, length, kind = WANDB_CHUNK_HEADER.unpack_from(data, pos)
        if pos + WANDB_CHUNK_HEADER.size + length > len(data):
            break  # a chunk still being written (the writer has not flushed it whole yet)
        chunk = data[pos + WANDB_CHUNK_HEADER.size : pos + WANDB_CHUNK_HEADER.size + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"corrupt chunk at byte {pos}"
        pos += WANDB_CHUNK_HEADER.size + length
        record += chunk
        if kind in WANDB_LAST_CHUNKS:
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def wandb_key(item) -> str:
    """A history item's metric name: wandb-core writes it as a one-element `nested_key` (a "/" in our
    keys is no nesting), older writers as `key`."""
    assert len(item.nested_key) <= 1, f"nested key {list(item.nested_key)}"
    return item.key or item.nested_key[0]


def test_wandb_offline_run_files_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = open_tracker("wandb:rlfleet-test", run_name="job-a", env={})
    tracker.log(1, STEP_1)
    tracker.log(2, STEP_2)
    tracker.close()
    (log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb-core (a separate process) may still be flushing its log when finish() returns: one CI run read
    # it without its run record; the file is whole once the exit record (the last one) is in it
    deadline = time.monotonic() + 60
    records = list(wandb_records(log))
    while not any(r.HasField("exit") for r in records):
        assert time.monotonic() < deadline, [r.WhichOneof("record_type") for r in records]
        time.sleep(0.2)
        records = list(wandb_records(log))
    (run,) = [r.run for r in records if r.HasField("run")]
    assert (run.project, run.display_name) == ("rlfleet-test", "job-a")
    history = {
        r.history.step.num: {
            key: json.loads(item.value_json)
            for item in r.history.item
            if not (key := wandb_key(item)).startswith("_")
        }  # W&B's _step, _runtime, ...
        for r in records
        if r.HasField("history")
    }
    assert history == {1: {"kl_k3": 0.25, "group/h100-fp8/oor_share": 0.5}, 2: {"kl_k3": 0.5}}
    assert [r.WhichOneof("record_type") for r in records][-1] == "exit"  # close() finished the run
