"""Environments for real models (trainer/envs/environments.py): the math final-answer environment, the
token-in / token-out multi-turn append (ChatTurnEncoder) with a real tokenizer and chat template, and
a full multi-turn episode through the real RolloutDriver whose trajectory is checked to be exactly
the ids the (fake, in-process) sampler produced plus the appended ids — never re-rendered. The
sampler here is a stub because no engine can run in this test; it only echoes ids."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from chat_tokenizer import build_chat_tokenizer
from support.episode_outcomes import finished_outcome
from support.scripted_turns import certain_turn

from rlfleet.records import SampledTurn
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.envs.environments import (
    ChatTurnEncoder,
    Environment,
    EnvironmentLoadError,
    EnvStep,
    EpisodeOutcome,
    MathEnv,
    ToyVocab,
    answers_match,
    extract_final_answer,
    load_environment,
)
from rlfleet.trainer.envs.prompts import Prompt, render_chat_prompt
from rlfleet.trainer.rollout.driver import GenerateFn, RolloutDriver


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}} and later 7", "\\frac{1}{2}"),  # the boxed answer wins over later numbers
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("48 / 2 = 24, 48 + 24 = 72\n#### 72", "72"),
        ("#### 1,000 is it; 3 more words", "1,000"),
        ("She has 3 apples and eats 1, leaving 2.", "2"),
        ("-3.5 degrees", "-3.5"),
        ("no number here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_final_answer(text: str, answer: str | None) -> None:
    assert extract_final_answer(text) == answer


def test_answers_match() -> None:
    assert (
        answers_match("1,000", "1000")
        and answers_match("72.0", "72")
        and answers_match("\\frac{1}{2}", "0.5")
    )
    assert answers_match("3/4", "0.75") and answers_match("x + 1", "x+1")
    assert not answers_match("71", "72") and not answers_match("x", "y")


def _reply(tok, text: str) -> list[int]:
    return tok.encode(text) + [tok.eos_token_id]  # what the sampler produced, ending with the stop token


def test_math_env_rewards_and_format_errors() -> None:
    tok = build_chat_tokenizer()
    env = load_environment("rlfleet.trainer.envs.environments:MathEnv", tokenizer=tok)
    assert isinstance(env, MathEnv) and env.stop_token_ids == (tok.eos_token_id,)
    prompt = Prompt(index=0, input_ids=[1], meta={"answer": "Natalia sold 48 + 24 = 72 clips. #### 72"})
    cases = {
        "The answer is \\boxed{72}.": (1.0, 0),
        "#### 72": (1.0, 0),
        "It is 71": (0.0, 0),
        "I do not know": (0.0, 1),
    }
    for text, (reward, errors) in cases.items():
        out = env.score(prompt, env.start(prompt), [_reply(tok, text)])
        assert (out.reward, out.format_errors, out.success) == (reward, errors, reward == 1.0), text
        assert not out.empty_final_reply and out.num_turns == 1
    assert env.score(prompt, {}, [[tok.eos_token_id]]).empty_final_reply
    with pytest.raises(KeyError, match="has no 'answer'"):
        env.score(Prompt(index=3, input_ids=[1]), {}, [_reply(tok, "5")])
    with pytest.raises(EnvironmentLoadError, match="needs the model's tokenizer"):
        load_environment("rlfleet.trainer.envs.environments:MathEnv")


def test_chat_turn_encoder_appends_the_template_delta() -> None:
    tok = build_chat_tokenizer()
    enc = ChatTurnEncoder(tok)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids = render_chat_prompt(tok, chat)
    call = _reply(tok, "calculator 2 + 3")
    appended = enc.append_ids(call, "result: 5")
    history = prompt_ids + call + appended
    # The appended ids make the token history equal to the template's rendering of the whole chat
    # (the model's own ids kept as sampled), ending with the next assistant generation prompt.
    full = [
        *chat,
        {"role": "assistant", "content": "calculator 2 + 3"},
        {"role": "tool", "content": "result: 5"},
    ]
    assert history == render_chat_prompt(tok, full)
    assert tok.decode(appended) == "\n<|im_start|>tool\nresult: 5<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut by the length budget (no end-of-turn token) is closed first.
    assert enc.append_ids(call[:-1], "result: 5") == [tok.eos_token_id] + appended
    with pytest.raises(ValueError, match="chat template"):
        ChatTurnEncoder(build_chat_tokenizer(None))


# Written here (not copied from a model repository): ChatML with Qwen3's think gate — the empty think
# block is rendered only for the LAST assistant turn after the last user query, so a past assistant
# turn renders differently from the same turn rendered last (why the history is never re-rendered).
THINK_GATED = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_chat_turn_encoder_with_a_think_gated_template() -> None:
    tok = build_chat_tokenizer(THINK_GATED)
    last = tok.apply_chat_template(
        [{"role": "user", "content": "1"}, {"role": "assistant", "content": "0"}], tokenize=False
    )
    assert "<think>" in last  # the gate is live: a re-rendered history would differ from what was sampled
    enc = ChatTurnEncoder(tok)
    assert enc.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")
    appended = enc.append_ids(_reply(tok, "calculator 2 + 3"), "result: 5")
    expected = (
        "\n<|im_start|>user\n<tool_response>\nresult: 5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(appended) == expected


def test_chat_turn_encoder_with_the_project_tiny_qwen3_tokenizer(tmp_path) -> None:
    """The tokenizer `rlfleet model tiny-qwen3` ships: its turns end with <sep>, not with EOS."""
    from transformers import AutoTokenizer

    from rlfleet.tiny_qwen3 import build_tokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    enc = ChatTurnEncoder(tok)
    assert enc.end_of_turn_id == tok.convert_tokens_to_ids("<sep>") != tok.eos_token_id
    assert set(enc.stop_token_ids) == {enc.end_of_turn_id, tok.eos_token_id}
    prompt = render_chat_prompt(tok, [{"role": "user", "content": "3 4"}])
    turn = tok.encode("w20 5", add_special_tokens=False) + [enc.end_of_turn_id]
    appended = enc.append_ids(turn, "7")
    full = [
        {"role": "user", "content": "3 4"},
        {"role": "assistant", "content": "w20 5"},
        {"role": "tool", "content": "7"},
    ]
    assert prompt + turn + appended == render_chat_prompt(tok, full)


class CalculatorEnv(Environment):
    """A user-style plugin: tool turn then answer turn, tool results appended as ids."""

    max_turns = 3

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.turns = ChatTurnEncoder(tokenizer)
        self.stop_token_ids = self.turns.stop_token_ids

    def step(self, prompt, state, output_ids, finish_reason) -> EnvStep:
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        if text.startswith("calculator"):
            return EnvStep(
                done=False, append_ids=self.turns.append_ids(output_ids, "result: 5"), tool_call=True
            )
        return EnvStep(done=True)

    def score(self, prompt, state, replies) -> EpisodeOutcome:
        text = self.tokenizer.decode(replies[-1], skip_special_tokens=True)
        return finished_outcome(float(extract_final_answer(text) == "5"), len(replies), len(replies) - 1)


def episode_driver(
    generate: GenerateFn, env: Environment, max_new_tokens: int, max_seq_len: int
) -> RolloutDriver:
    """A driver for the episodes a test runs itself (`run_episode(prompt, index)`): no prompt source."""
    return RolloutDriver(
        generate,
        env,
        None,  # type: ignore[arg-type]
        samples_per_prompt=1,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens),
        max_seq_len=max_seq_len,
    )


def test_multi_turn_episode_is_token_in_token_out_through_the_driver() -> None:
    tok = build_chat_tokenizer()
    env = CalculatorEnv(tok)
    prompt = Prompt(
        index=0, input_ids=render_chat_prompt(tok, [{"role": "user", "content": "What is 2 + 3?"}])
    )
    replies = [_reply(tok, "calculator 2 + 3"), _reply(tok, "The answer is \\boxed{5}.")]
    sent: list[list[int]] = []

    async def generate(session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        sent.append(list(ids))
        return certain_turn(ids, replies[len(sent) - 1])

    driver = episode_driver(generate, env, max_new_tokens=32, max_seq_len=512)
    rollout = asyncio.run(driver.run_episode(prompt, 0))
    assert rollout.outcome is not None and rollout.outcome.reward == 1.0 and rollout.outcome.tool_calls == 1
    tool = env.turns.append_ids(replies[0], "result: 5")
    # Turn 2 was sent exactly prompt + sampled ids + appended ids: the history was not re-rendered.
    assert sent[1] == prompt.input_ids + replies[0] + tool
    assert rollout.token_ids().tolist() == prompt.input_ids + replies[0] + tool + replies[1]
    mask = rollout.loss_mask()
    assert mask.sum() == len(replies[0]) + len(replies[1])  # only the sampled ids are trained on


class _WaitForTheOtherEpisode(Environment):
    """One turn; the first episode's step blocks (as a long sandboxed command does) until the second
    episode's step has run: only possible while the first one's step is off the event loop."""

    def __init__(self) -> None:
        self.second_step = threading.Event()
        self.steps = 0
        self.lock = threading.Lock()

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        with self.lock:
            self.steps += 1
            first = self.steps == 1
        if first:
            state["saw_the_other"] = self.second_step.wait(timeout=30)
        else:
            self.second_step.set()
            state["saw_the_other"] = True
        return EnvStep(done=True)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        return finished_outcome(float(state["saw_the_other"]), num_turns=1, tool_calls=0)


def test_an_environment_step_that_blocks_does_not_hold_up_the_other_episodes() -> None:
    env = _WaitForTheOtherEpisode()

    async def generate(session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        return certain_turn(ids, [ToyVocab.EOS])

    driver = episode_driver(generate, env, max_new_tokens=4, max_seq_len=64)
    prompt = Prompt(index=0, input_ids=[1, 2, 3])

    async def both() -> list[Any]:
        return list(await asyncio.gather(driver.run_episode(prompt, 0), driver.run_episode(prompt, 1)))

    rollouts = asyncio.run(both())
    assert env.steps == 2
    assert [r.outcome.reward for r in rollouts] == [1.0, 1.0]  # the blocked step saw the other's, no timeout
