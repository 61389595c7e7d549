"""Prompt sources: a JSONL file of token ids, a JSONL / Parquet prompt set read through HF `datasets`
(text prompts rendered with the model's chat template), or a built-in seeded generator, all
addressed by a global index.

The index is the data position a checkpoint stores: prompt i is always the same prompt (files: row
i mod n, in a per-epoch seeded order; generator: a pure function of (seed, i)), so resuming at
position i continues the exact stream without re-serving consumed prompts.

Text prompts are rendered ONCE, here, with `tokenizer.apply_chat_template(messages, tokenize=True,
add_generation_prompt=True)`; from then on the trajectory is token ids only (the sampler extends the
ids, environments append ids: trainer/envs/environments.py ChatTurnEncoder), so the trainer scores
exactly the ids the sampler produced (docs/environments.md).
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


def _epoch_order(cache: dict[int, np.ndarray], n: int, seed: int, shuffle: bool, epoch: int) -> np.ndarray:
    """Row order of epoch `epoch`: a permutation seeded by (seed, epoch), or file order."""
    if epoch not in cache:
        cache[epoch] = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    return cache[epoch]


class JsonlPromptSource:
    """One JSON object per line: {"input_ids": [int, ...], ...}; every other key goes to `meta`.

    Token ids only (the trainer never tokenises text). Epoch e visits the lines in a permutation
    seeded by (seed, e); `shuffle=False` keeps file order.
    """

    def __init__(
        self, path: str | Path, seed: int = 0, shuffle: bool = True, vocab_size: int | None = None
    ) -> None:
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
                raise PromptFileError(
                    f"{self.path}:{lineno}: 'input_ids' must be a non-empty list of token ids"
                )
            if vocab_size is not None and max(ids) >= vocab_size:
                raise PromptFileError(f"{self.path}:{lineno}: token id {max(ids)} >= vocab size {vocab_size}")
            meta = obj.pop("meta", {}) if isinstance(obj.get("meta", {}), dict) else {}
            meta.update(obj)
            self.rows.append((ids, meta))
        if not self.rows:
            raise PromptFileError(f"prompt file {str(self.path)!r} has no prompts")
        self._perm_cache: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        return _epoch_order(self._perm_cache, len(self.rows), self.seed, self.shuffle, epoch)

    def get(self, index: int) -> Prompt:
        n = len(self.rows)
        row = int(self._order(index // n)[index % n])
        ids, meta = self.rows[row]
        return Prompt(index=index, input_ids=list(ids), meta={**meta, "row": row})


DATASET_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt's token ids: the chat template applied once, with the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptFileError("the tokenizer has no chat template; give prompts as 'input_ids' instead")
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


class DatasetPromptSource:
    """A JSONL or Parquet prompt set read with HF `datasets` (`load_dataset("json" | "parquet",
    data_files=path)`), one prompt per row, in the same index / epoch / seeded order as JSONL files.

    A row holds ONE of: `input_ids` (token ids, used as they are), `messages` (a chat: a list of
    {"role", "content"}) or `prompt` (text: one user message); `messages` / `prompt` need the model's
    tokenizer and are rendered with its chat template once, when the prompt is first served. Every
    other column goes to `Prompt.meta` (e.g. `answer` for the math environment).
    """

    PROMPT_COLUMNS = ("input_ids", "messages", "prompt")

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any = None,
        seed: int = 0,
        shuffle: bool = True,
        vocab_size: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.tokenizer = tokenizer
        self.seed = seed
        self.shuffle = shuffle
        self.vocab_size = vocab_size
        fmt = DATASET_FORMATS.get(self.path.suffix.lower())
        if fmt is None:
            raise PromptFileError(
                f"prompt set {str(self.path)!r}: expected a {', '.join(DATASET_FORMATS)} file"
            )
        if not self.path.is_file():
            raise PromptFileError(f"prompt file {str(self.path)!r} does not exist")
        from datasets import load_dataset

        try:
            self.data = load_dataset(fmt, data_files=str(self.path), split="train")
        except Exception as exc:  # datasets wraps parser errors in several exception types
            raise PromptFileError(
                f"prompt set {str(self.path)!r} cannot be read: {str(exc).splitlines()[0]}"
            ) from None
        if len(self.data) == 0:
            raise PromptFileError(f"prompt file {str(self.path)!r} has no prompts")
        columns = [c for c in self.PROMPT_COLUMNS if c in self.data.column_names]
        if len(columns) != 1:
            raise PromptFileError(
                f"prompt set {str(self.path)!r}: needs exactly one of the columns {list(self.PROMPT_COLUMNS)}, "
                f"has {self.data.column_names}"
            )
        self.column = columns[0]
        if self.column != "input_ids" and tokenizer is None:
            raise PromptFileError(
                f"prompt set {str(self.path)!r} holds text ({self.column!r}): it needs the model's tokenizer"
            )
        self._perm_cache: dict[int, np.ndarray] = {}
        self._rendered: dict[int, list[int]] = {}

    def _ids(self, row: int, value: Any) -> list[int]:
        if row in self._rendered:
            return self._rendered[row]
        where = f"{self.path} row {row}"
        if self.column == "input_ids":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(t, int) and t >= 0 for t in value)
            ):
                raise PromptFileError(f"{where}: 'input_ids' must be a non-empty list of token ids")
            ids = list(value)
        else:
            messages = [{"role": "user", "content": value}] if self.column == "prompt" else value
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise PromptFileError(
                    f"{where}: {self.column!r} must be text or a list of {{role, content}} messages"
                )
            if self.column == "prompt" and not isinstance(value, str):
                raise PromptFileError(f"{where}: 'prompt' must be text")
            ids = render_chat_prompt(self.tokenizer, messages)
        if self.vocab_size is not None and max(ids) >= self.vocab_size:
            raise PromptFileError(f"{where}: token id {max(ids)} >= vocab size {self.vocab_size}")
        self._rendered[row] = ids
        return ids

    def get(self, index: int) -> Prompt:
        n = len(self.data)
        row = int(_epoch_order(self._perm_cache, n, self.seed, self.shuffle, index // n)[index % n])
        record = dict(self.data[row])
        ids = self._ids(row, record.pop(self.column))
        meta = record.pop("meta", None)
        meta = dict(meta) if isinstance(meta, dict) else {}
        meta.update(record)
        return Prompt(index=index, input_ids=list(ids), meta={**meta, "row": row})


class GeneratedPromptSource:
    """Built-in toy prompts: a pure function of (task, seed, index)."""

    TASKS = ("copy_digit", "same_parity", "tool_add", "retry_digit")
    RETRY_SHOWN_SHARE = 0.6  # retry_digit: share of prompts whose hidden digit is the shown one

    def __init__(self, task: str, seed: int = 0) -> None:
        if task not in self.TASKS:
            raise PromptFileError(f"no built-in prompt generator for task {task!r} (have {list(self.TASKS)})")
        self.task = task
        self.seed = seed

    def get(self, index: int) -> Prompt:
        from rlfleet.trainer.envs.environments import copy_digit_prompt, retry_digit_prompt, tool_add_prompt

        rng = np.random.default_rng([self.seed, index])
        if self.task in ("copy_digit", "same_parity"):  # both: one digit to answer about
            return copy_digit_prompt(index, int(rng.integers(10)))
        if self.task == "retry_digit":
            shown, other, coin = int(rng.integers(10)), int(rng.integers(10)), float(rng.random())
            return retry_digit_prompt(index, shown, shown if coin < self.RETRY_SHOWN_SHARE else other)
        a, b = (int(x) for x in rng.integers(10, size=2))
        return tool_add_prompt(index, a, b)


def open_prompt_source(
    dataset: str | None, task: str, seed: int = 0, vocab_size: int | None = None, tokenizer: Any = None
) -> PromptSource:
    """`dataset` is None / "builtin" / "builtin:<task>" for the generator, or a file: without a
    tokenizer a JSONL of token ids (read line by line: errors name the line); a `.parquet` file, or a
    `.jsonl` / `.json` one with the model's tokenizer, is a prompt set read through HF datasets (text
    rendered with the chat template)."""
    if dataset is None or dataset in ("", "builtin"):
        if task not in GeneratedPromptSource.TASKS:  # a reward plugin or a real-model environment
            raise PromptFileError(
                f"rollout.environment {task!r} has no built-in prompts: set rollout.dataset to a prompt file "
                f"(docs/environments.md) or to builtin:<task> (one of {', '.join(GeneratedPromptSource.TASKS)})"
            )
        return GeneratedPromptSource(task, seed)
    if dataset.startswith("builtin:"):
        return GeneratedPromptSource(dataset.split(":", 1)[1], seed)
    suffix = Path(dataset).suffix.lower()
    if suffix == ".parquet" or (tokenizer is not None and suffix in DATASET_FORMATS):
        return DatasetPromptSource(dataset, tokenizer=tokenizer, seed=seed, vocab_size=vocab_size)
    return JsonlPromptSource(dataset, seed=seed, vocab_size=vocab_size)
