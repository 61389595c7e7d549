"""The run's rollout inputs (trainer/run.py `rollout_inputs`, used by local mode and the cluster
entrypoint's make_driver): with an HF base that has a tokenizer (the project's tiny Qwen3,
rlfleet/tiny_qwen3.py, chat template included) the prompt source and the environment both get that
tokenizer, loaded with transformers' AutoTokenizer; text prompts are rendered with its real chat
template. An HF checkpoint without tokenizer files keeps token-id prompts and tokenizer-free
environments."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.tiny_models import LOOP_MODEL

from rlfleet.trainer.config import RunConfig
from rlfleet.trainer.envs.prompts import PromptFileError
from rlfleet.trainer.run import BaseModel, load_tokenizer, rollout_inputs


def test_hf_base_tokenizer_reaches_the_prompt_source_and_the_environment(
    tmp_path: Path, tiny_qwen3_dir: Path, example_run: Callable[..., RunConfig]
) -> None:
    from transformers import AutoTokenizer

    source = tiny_qwen3_dir
    config = json.loads((source / "config.json").read_text())
    base = BaseModel(backend=None, vocab_size=int(config["vocab_size"]), max_seq_len=64, source_dir=source)
    chat = [{"role": "user", "content": "2 + 3"}]
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(json.dumps({"messages": chat, "answer": "5"}) + "\n")

    env, prompts = rollout_inputs(
        example_run(
            environment="rlfleet.trainer.envs.environments:MathEnv", dataset=str(dataset), seed=0, max_turns=1
        ),
        base,
    )
    assert env.tokenizer is prompts.tokenizer is not None  # one tokenizer, from the base checkpoint
    assert env.tokenizer.name_or_path == str(source)
    prompt = prompts.get(0)
    reference = AutoTokenizer.from_pretrained(str(source))
    expected = reference.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if not isinstance(expected, list) else expected
    assert prompt.input_ids == list(expected) and prompt.meta["answer"] == "5"


def test_checkpoint_without_tokenizer_keeps_token_id_prompts(
    tmp_path: Path, example_run: Callable[..., RunConfig]
) -> None:
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

    checkpoint = tmp_path / "no-tokenizer"
    tiny_model(TinyQwen3(**LOOP_MODEL)).save_pretrained(checkpoint)  # config + weights only
    assert (checkpoint / "config.json").is_file() and not list(checkpoint.glob("tokenizer*"))
    base = BaseModel(backend=None, vocab_size=32, max_seq_len=48, source_dir=checkpoint)
    assert base.base_checkpoint == checkpoint and load_tokenizer(base) is None
    env, prompts = rollout_inputs(
        example_run(environment="copy_digit", dataset=None, seed=0, max_turns=1), base
    )  # today's behaviour: generated token ids
    assert all(0 <= t < 32 for t in prompts.get(0).input_ids)
    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "2 + 3"}]), text)
    with pytest.raises(PromptFileError, match="it needs the model's tokenizer"):
        rollout_inputs(example_run(environment="copy_digit", dataset=str(text), seed=0, max_turns=1), base)


def test_an_environment_without_built_in_prompts_and_no_dataset_says_to_set_one(
    tmp_path: Path, example_run: Callable[..., RunConfig]
) -> None:
    """The cluster entrypoint's make_driver path: a reward plugin or a real-model environment (here
    MathEnv, by entry point) with no rollout.dataset is told to set one, not that a generator for the
    task 'module:attr' is missing."""
    from rlfleet.tiny_qwen3 import TinyQwen3, tiny_model

    checkpoint = tmp_path / "model"
    tiny_model(TinyQwen3(**LOOP_MODEL)).save_pretrained(checkpoint)
    base = BaseModel(backend=None, vocab_size=32, max_seq_len=48, source_dir=checkpoint)
    plugin = "rlfleet.trainer.envs.environments:MathEnv"
    for dataset in (None, "", "builtin"):
        with pytest.raises(PromptFileError) as err:
            rollout_inputs(example_run(environment=plugin, dataset=dataset, seed=0, max_turns=1), base)
        assert str(err.value) == (
            f"rollout.environment {plugin!r} has no built-in prompts: set rollout.dataset to a prompt file "
            "(docs/environments.md) or to builtin:<task> (one of copy_digit, same_parity, tool_add, retry_digit)"
        )
