"""The cluster entrypoint's rollout inputs (trainer/entrypoint.py `rollout_inputs`, used by its
make_driver): with an HF base that has a tokenizer (the project's tiny Qwen3, rlfleet/tiny_qwen3.py,
chat template included) the prompt source and the environment both get that tokenizer, loaded with
transformers' AutoTokenizer; text prompts are rendered with its real chat template. A TinyGPT view
(no tokenizer) keeps token-id prompts and tokenizer-free environments."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.numerics.tinygpt import TinyGPT, TinyGPTConfig
from rlfleet.numerics.views import save_view
from rlfleet.trainer.entrypoint import rollout_inputs
from rlfleet.trainer.prompts import PromptFileError
from rlfleet.trainer.run import BaseModel, load_tokenizer


def _rc(environment: str, dataset: str | None) -> SimpleNamespace:
    return SimpleNamespace(environment=environment, dataset=dataset, seed=0, max_turns=1)


def test_hf_base_tokenizer_reaches_the_prompt_source_and_the_environment(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from rlfleet.tiny_qwen3 import build_tiny_qwen3

    source = build_tiny_qwen3(tmp_path / "qwen3")
    config = json.loads((source / "config.json").read_text())
    base = BaseModel(backend=None, vocab_size=int(config["vocab_size"]), max_seq_len=64, source_dir=source)
    chat = [{"role": "user", "content": "2 + 3"}]
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(json.dumps({"messages": chat, "answer": "5"}) + "\n")

    env, prompts = rollout_inputs(_rc("rlfleet.trainer.environments:MathEnv", str(dataset)), base)
    assert env.tokenizer is prompts.tokenizer is not None  # one tokenizer, from the base checkpoint
    assert env.tokenizer.name_or_path == str(source)
    prompt = prompts.get(0)
    reference = AutoTokenizer.from_pretrained(str(source))
    expected = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert prompt.input_ids == list(expected) and prompt.meta["answer"] == "5"


def test_tinygpt_view_has_no_tokenizer_and_keeps_token_id_prompts(tmp_path: Path) -> None:
    cfg = TinyGPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=32, max_seq_len=48, seed=0)
    view = tmp_path / "view"
    save_view(TinyGPT(cfg).state_dict(), "bf16", view)
    assert not (view / "config.json").exists()
    base = BaseModel(backend=None, vocab_size=32, max_seq_len=48, source_dir=view)
    assert load_tokenizer(base) is None and load_tokenizer(BaseModel(None, 32, 48, None)) is None
    env, prompts = rollout_inputs(_rc("copy_digit", None), base)  # today's behaviour: generated token ids
    assert all(0 <= t < 32 for t in prompts.get(0).input_ids)
    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2 + 3"}]), text)
    with pytest.raises(PromptFileError, match="it needs the model's tokenizer"):
        rollout_inputs(_rc("copy_digit", str(text)), base)
