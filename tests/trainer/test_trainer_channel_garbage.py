"""The trainer on a channel whose `pointer.json` is garbage (issue 39 item 9): the REAL entrypoint process
(`rlfleet trainer run`, the tiny Qwen3 checkpoint, a filesystem channel) says one line naming the store,
the damaged record and the fix, and exits 10 (trainer/failures.py, "channel-unreadable"), with no
traceback; before, the pointer's parse error escaped as a traceback (exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_trainer_failures import _said, _trainer  # the failure tests' one copy

from rlfleet.channel import POINTER_KEY


@pytest.mark.slow
def test_a_garbage_pointer_stops_the_trainer_with_one_line(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    channels = {"not utf-8": b"\x80\x81 not a pointer", "a list": b"[1, 2, 3]"}
    runs = {}
    for name, garbage in channels.items():
        channel = tmp_path / name.replace(" ", "-") / "channel"
        channel.mkdir(parents=True)
        (channel / POINTER_KEY).write_bytes(garbage)
        runs[name] = (channel, _trainer(tmp_path / name.replace(" ", "-"), tiny_qwen3_dir, channel))
    said = {name: (channel, _said(proc)) for name, (channel, proc) in runs.items()}

    channel, (code, line) = said["not utf-8"]
    assert code == 10, line
    assert line.startswith(
        f"the weight channel {channel} cannot be used: {channel / POINTER_KEY}: unreadable "
        "pointer (UnicodeDecodeError: 'utf-8' codec can't decode byte 0x80 in position 0"
    ), line
    assert "Fix: a record in it is damaged (restore it, or delete a damaged pointer.json" in line
    assert "the trainer resumes from its last checkpoint when its pod restarts" in line
    channel, (code, line) = said["a list"]
    assert code == 10 and "unreadable pointer (TypeError: list indices must be integers" in line, line
