"""Prompt sets through HF datasets (trainer/envs/prompts.py DatasetPromptSource): JSONL and Parquet files
(real files written here), text rendered ONCE with the model's chat template through transformers'
own `apply_chat_template`, the index / epoch / seeded-order semantics of the JSONL token-id source,
and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_tokenizer import build_chat_tokenizer

from rlfleet.trainer.envs.prompts import (
    DatasetPromptSource,
    JsonlPromptSource,
    PromptFileError,
    open_prompt_source,
    render_chat_prompt,
)

ROWS = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(5)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_text_prompts_are_rendered_once_with_the_chat_template(tmp_path: Path) -> None:
    tok = build_chat_tokenizer()
    src = DatasetPromptSource(write_jsonl(tmp_path / "p.jsonl", ROWS), tokenizer=tok, shuffle=False)
    p = src.get(2)
    assert tok.decode(p.input_ids) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=True, add_generation_prompt=True
    )["input_ids"]
    assert p.input_ids == list(expected)
    assert p.meta == {"answer": "5", "row": 2}
    # Rendered once: the second epoch serves the cached ids of the same row.
    calls = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or real(*a, **k)
    assert src.get(2 + len(ROWS)).input_ids == p.input_ids and calls == []


def test_parquet_and_jsonl_give_the_same_stream_and_keep_the_seeded_order(tmp_path: Path) -> None:
    tok = build_chat_tokenizer()
    a = DatasetPromptSource(write_jsonl(tmp_path / "p.jsonl", ROWS), tokenizer=tok, seed=3)
    b = DatasetPromptSource(write_parquet(tmp_path / "p.parquet", ROWS), tokenizer=tok, seed=3)
    stream_a = [(p.input_ids, p.meta) for p in map(a.get, range(12))]
    assert stream_a == [(p.input_ids, p.meta) for p in map(b.get, range(12))]
    # The same permutation per epoch as the JSONL token-id source (one order rule for every file).
    ids_path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [i + 1]} for i in range(5)])
    ref = JsonlPromptSource(ids_path, seed=3)
    assert [p.meta["row"] for p in map(a.get, range(12))] == [ref.get(i).meta["row"] for i in range(12)]
    rows_epoch0 = [a.get(i).meta["row"] for i in range(5)]
    assert sorted(rows_epoch0) == list(range(5)) and rows_epoch0 != list(range(5))


def test_messages_and_input_ids_columns(tmp_path: Path) -> None:
    tok = build_chat_tokenizer()
    chat = [{"role": "system", "content": "calculator"}, {"role": "user", "content": "What is 2 + 3?"}]
    src = DatasetPromptSource(
        write_parquet(tmp_path / "m.parquet", [{"messages": chat, "answer": "5"}]), tokenizer=tok
    )
    assert src.get(0).input_ids == render_chat_prompt(tok, chat)
    assert tok.decode(src.get(0).input_ids).startswith("<|im_start|>system\ncalculator<|im_end|>\n")
    ids = DatasetPromptSource(
        write_parquet(tmp_path / "i.parquet", [{"input_ids": [5, 6, 7], "answer": "1"}])
    )
    assert ids.get(0).input_ids == [5, 6, 7] and ids.get(0).meta == {"answer": "1", "row": 0}


def test_open_prompt_source_routes(tmp_path: Path) -> None:
    tok = build_chat_tokenizer()
    text = write_jsonl(tmp_path / "t.jsonl", ROWS)
    assert isinstance(open_prompt_source(str(text), "copy_digit", tokenizer=tok), DatasetPromptSource)
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2]}])
    assert isinstance(open_prompt_source(str(ids), "copy_digit"), JsonlPromptSource)  # local mode, unchanged
    pqf = write_parquet(tmp_path / "i.parquet", [{"input_ids": [1, 2]}])
    assert isinstance(open_prompt_source(str(pqf), "copy_digit"), DatasetPromptSource)


def test_clear_errors(tmp_path: Path) -> None:
    tok = build_chat_tokenizer()
    with pytest.raises(PromptFileError, match="needs the model's tokenizer"):
        DatasetPromptSource(write_parquet(tmp_path / "t.parquet", ROWS))
    with pytest.raises(PromptFileError, match="has no chat template"):
        DatasetPromptSource(
            write_parquet(tmp_path / "t2.parquet", ROWS), tokenizer=build_chat_tokenizer(None)
        ).get(0)
    with pytest.raises(PromptFileError, match="needs exactly one of the columns"):
        DatasetPromptSource(write_parquet(tmp_path / "x.parquet", [{"question": "q"}]), tokenizer=tok)
    with pytest.raises(PromptFileError, match="expected a .jsonl, .json, .parquet file"):
        DatasetPromptSource(tmp_path / "p.csv", tokenizer=tok)
    with pytest.raises(PromptFileError, match="does not exist"):
        DatasetPromptSource(tmp_path / "missing.parquet")
    with pytest.raises(PromptFileError, match="cannot be read"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n')
        DatasetPromptSource(tmp_path / "bad.jsonl", tokenizer=tok)
    with pytest.raises(PromptFileError, match=r"token id \d+ >= vocab size 10"):
        DatasetPromptSource(write_jsonl(tmp_path / "v.jsonl", ROWS), tokenizer=tok, vocab_size=10).get(0)
