"""`rlfleet env try` refuses a bad policy file in one line naming the file and line (issue 39 item 9):
before, a policy line that was JSON but not an object (`[1, 2]`, `3`) ended in an AttributeError's
traceback. Run as a user runs it (the real CLI entry, a subprocess); no sandbox is needed: the policy is
read before any episode runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.env_try import env_try_swe

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "swe" / "tasks.jsonl"
SHAPE = "a policy line is {'instance_id': str, 'replies': [str, ...]}"


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("[1, 2]", SHAPE),
        ("3", SHAPE),
        ('"replies"', SHAPE),
        ("null", SHAPE),
        ('{"instance_id": 7, "replies": []}', SHAPE),
        ('{"instance_id": "calc-add", "replies": "fix it"}', SHAPE),
        (
            "{not json",
            "not JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        ),
    ],
)
def test_a_bad_policy_line_is_one_line_naming_the_file_and_line(tmp_path, line, error) -> None:
    policy = tmp_path / "policy.jsonl"
    policy.write_text(f"\n{line}\n")  # the blank first line is skipped; the bad one is line 2
    result = env_try_swe(TASKS, policy)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == f"rlfleet env try: {policy}:2: {error}\n"
