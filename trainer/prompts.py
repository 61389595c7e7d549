"""Prompt sources: a JSONL file or a built-in seeded generator, both addressed by a global index.

The index is the data position a checkpoint stores: prompt i is always the same prompt (JSONL: line
i mod n, in a per-epoch seeded order; generator: a pure function of (seed, i)), so resuming at
position i continues the exact stream without re-serving consumed prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass
class Prompt:
    index: int  # global position in the stream (the data position)
    input_ids: list[int]
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. the verifiable answer

    @property
    def prompt_id(self) -> str:
        return f"p{self.index}"


class PromptSource(Protocol):
    def get(self, index: int) -> Prompt: ...


class PromptFileError(ValueError):
    """A JSONL prompt file is unusable (clear, one line)."""


class JsonlPromptSource:
    """One JSON object per line: {"input_ids": [int, ...], ...}; every other key goes to `meta`.

    Token ids only (the trainer never tokenises text). Epoch e visits the lines in a permutation
    seeded by (seed, e); `shuffle=False` keeps file order.
    """

    def __init__(self, path: str | Path, seed: int = 0, shuffle: bool = True, vocab_size: int | None = None) -> None:
        self.path = Path(path)
        self.seed = seed
        self.shuffle = shuffle
        if not self.path.is_file():
            raise PromptFileError(f"prompt file {str(self.path)!r} does not exist")
        self.rows: list[tuple[list[int], dict[str, Any]]] = []
        for lineno, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{self.path}:{lineno}: invalid JSON ({exc.msg})") from None
            ids = obj.pop("input_ids", None) if isinstance(obj, dict) else None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise PromptFileError(f"{self.path}:{lineno}: 'input_ids' must be a non-empty list of token ids")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise PromptFileError(f"{self.path}:{lineno}: token id {max(ids)} >= vocab size {vocab_size}")
            meta = obj.pop("meta", {}) if isinstance(obj.get("meta", {}), dict) else {}
            meta.update(obj)
            self.rows.append((ids, meta))
        if not self.rows:
            raise PromptFileError(f"prompt file {str(self.path)!r} has no prompts")
        self._perm_cache: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            n = len(self.rows)
            self._perm_cache[epoch] = (
                np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            )
        return self._perm_cache[epoch]

    def get(self, index: int) -> Prompt:
        n = len(self.rows)
        row = int(self._order(index // n)[index % n])
        ids, meta = self.rows[row]
        return Prompt(index=index, input_ids=list(ids), meta={**meta, "row": row})


class GeneratedPromptSource:
    """Built-in toy prompts: a pure function of (task, seed, index)."""

    TASKS = ("copy_digit", "tool_add")

    def __init__(self, task: str, seed: int = 0) -> None:
        if task not in self.TASKS:
            raise PromptFileError(f"no built-in prompt generator for task {task!r} (have {list(self.TASKS)})")
        self.task = task
        self.seed = seed

    def get(self, index: int) -> Prompt:
        from rlfleet.trainer.environments import copy_digit_prompt, tool_add_prompt

        rng = np.random.default_rng([self.seed, index])
        if self.task == "copy_digit":
            return copy_digit_prompt(index, int(rng.integers(10)))
        a, b = (int(x) for x in rng.integers(10, size=2))
        return tool_add_prompt(index, a, b)


def open_prompt_source(dataset: str | None, task: str, seed: int = 0, vocab_size: int | None = None) -> PromptSource:
    """`dataset` is a JSONL path, or None / "builtin" / "builtin:<task>" for the generator."""
    if dataset in (None, "", "builtin"):
        return GeneratedPromptSource(task, seed)
    if dataset.startswith("builtin:"):
        return GeneratedPromptSource(dataset.split(":", 1)[1], seed)
    return JsonlPromptSource(dataset, seed=seed, vocab_size=vocab_size)
