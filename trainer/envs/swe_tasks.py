"""The shipped SWE tasks: tiny Python repositories, each with a planted bug, a statement and hidden
tests, and the scripted correct policy for each (one tool-call reply per turn). Deterministic:
`scripts/build-swe-tasks` (this module's `main`) writes examples/swe/tasks.jsonl and
examples/swe/solutions.jsonl, and tests/trainer/test_trainer_swe_env.py checks the committed files
are what it builds. Grading runs `python3 -m unittest` (the standard library, nothing to install in
the sandbox)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlfleet.trainer.envs.swe_env import SweTask

TEST_COMMAND = "python3 -m unittest discover -s tests -t . -q"


def _repo(module: str, source: str, visible_test: str) -> dict[str, str]:
    return {
        f"{module}/__init__.py": source,
        "tests/__init__.py": "",
        "tests/test_visible.py": visible_test,
        "README.md": f"# {module}\n\nRun the tests: `{TEST_COMMAND}`\n",
    }


def _task(instance_id: str, statement: str, module: str, source: str, visible: str, hidden: str) -> SweTask:
    return SweTask(
        instance_id=instance_id,
        statement=statement,
        files=_repo(module, source, visible),
        hidden_tests={"tests/test_hidden.py": hidden},
        test_command=TEST_COMMAND,
        test_timeout_s=60.0,
    )


# (task, the fix as (path, old, new))
SHIPPED: list[tuple[SweTask, tuple[str, str, str]]] = [
    (
        _task(
            "stats-mean",
            "`stats.mean([1, 2, 3])` returns 3.0 instead of 2.0. Fix `mean` so it returns the arithmetic mean.",
            "stats",
            'def mean(values):\n    """The arithmetic mean of a non-empty sequence."""\n'
            "    return sum(values) / (len(values) - 1)\n",
            "import unittest\n\nfrom stats import mean\n\n\nclass Visible(unittest.TestCase):\n"
            "    def test_callable(self):\n        self.assertTrue(callable(mean))\n",
            "import unittest\n\nfrom stats import mean\n\n\nclass Hidden(unittest.TestCase):\n"
            "    def test_mean(self):\n        self.assertEqual(mean([1, 2, 3]), 2.0)\n"
            "        self.assertEqual(mean([5]), 5.0)\n        self.assertEqual(mean([1.5, 2.5]), 2.0)\n",
        ),
        ("stats/__init__.py", "(len(values) - 1)", "len(values)"),
    ),
    (
        _task(
            "text-slugify",
            '`text.slugify("  Hello   World ")` returns "--hello---world-"; it should return "hello-world": '
            "words in lower case joined by single dashes, no dashes at either end.",
            "text",
            'def slugify(title):\n    """A URL slug: the words of `title` in lower case, joined by dashes."""\n'
            '    return title.lower().replace(" ", "-")\n',
            "import unittest\n\nfrom text import slugify\n\n\nclass Visible(unittest.TestCase):\n"
            '    def test_one_word(self):\n        self.assertEqual(slugify("Hello"), "hello")\n',
            "import unittest\n\nfrom text import slugify\n\n\nclass Hidden(unittest.TestCase):\n"
            '    def test_spaces(self):\n        self.assertEqual(slugify("  Hello   World "), "hello-world")\n'
            '        self.assertEqual(slugify("a b"), "a-b")\n        self.assertEqual(slugify(""), "")\n',
        ),
        ("text/__init__.py", 'title.lower().replace(" ", "-")', '"-".join(title.lower().split())'),
    ),
    (
        _task(
            "intervals-touching",
            "`intervals.merge([(1, 2), (2, 3)])` returns [(1, 2), (2, 3)]; touching intervals must merge: "
            "the answer is [(1, 3)].",
            "intervals",
            'def merge(intervals):\n    """Merge overlapping or touching closed intervals; sorted output."""\n'
            "    out = []\n    for start, end in sorted(intervals):\n"
            "        if out and start < out[-1][1]:\n            out[-1] = (out[-1][0], max(out[-1][1], end))\n"
            "        else:\n            out.append((start, end))\n    return out\n",
            "import unittest\n\nfrom intervals import merge\n\n\nclass Visible(unittest.TestCase):\n"
            "    def test_overlap(self):\n        self.assertEqual(merge([(1, 4), (2, 3)]), [(1, 4)])\n",
            "import unittest\n\nfrom intervals import merge\n\n\nclass Hidden(unittest.TestCase):\n"
            "    def test_touching(self):\n        self.assertEqual(merge([(1, 2), (2, 3)]), [(1, 3)])\n"
            "        self.assertEqual(merge([(5, 6), (1, 2)]), [(1, 2), (5, 6)])\n",
        ),
        ("intervals/__init__.py", "start < out[-1][1]", "start <= out[-1][1]"),
    ),
    (
        _task(
            "stack-empty-pop",
            "`stack.Stack().pop()` on an empty stack returns None; it must raise IndexError.",
            "stack",
            "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, item):\n        self.items.append(item)\n\n"
            "    def pop(self):\n        if not self.items:\n            return None\n        return self.items.pop()\n",
            "import unittest\n\nfrom stack import Stack\n\n\nclass Visible(unittest.TestCase):\n"
            "    def test_push_pop(self):\n        s = Stack()\n        s.push(1)\n        self.assertEqual(s.pop(), 1)\n",
            "import unittest\n\nfrom stack import Stack\n\n\nclass Hidden(unittest.TestCase):\n"
            "    def test_empty(self):\n        with self.assertRaises(IndexError):\n            Stack().pop()\n",
        ),
        (
            "stack/__init__.py",
            "            return None\n",
            '            raise IndexError("pop from an empty stack")\n',
        ),
    ),
]


def tool_call(name: str, **arguments: object) -> str:
    """A reply that calls one tool, in the protocol's format (trainer/envs/swe_env.py)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def correct_replies(fix: tuple[str, str, str]) -> list[str]:
    path, old, new = fix
    return [
        "Let me look at the repository.\n"
        + tool_call("bash", command="ls -R && " + TEST_COMMAND, timeout=30),
        tool_call("edit", path=path, old=old, new=new),
        tool_call("submit"),
    ]


def build(out_dir: Path) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    tasks, solutions = out_dir / "tasks.jsonl", out_dir / "solutions.jsonl"
    tasks.write_text("".join(json.dumps(t.row(), sort_keys=True) + "\n" for t, _ in SHIPPED))
    solutions.write_text(
        "".join(
            json.dumps({"instance_id": t.instance_id, "replies": correct_replies(fix)}, sort_keys=True) + "\n"
            for t, fix in SHIPPED
        )
    )
    return tasks, solutions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the shipped SWE tasks and their scripted solutions")
    parser.add_argument("--out", type=Path, default=Path("examples/swe"))
    for path in build(parser.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
