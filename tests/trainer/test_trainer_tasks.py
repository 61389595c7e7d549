"""Rewards of the built-in toy tasks, exact (hand-computed expectations)."""

from __future__ import annotations

import pytest

from rlfleet.trainer.envs import environments as env_mod
from rlfleet.trainer.envs.environments import ToyVocab, copy_digit_prompt, same_parity_reward, tool_add_prompt

D = ToyVocab.digit
EOS, CALL, END = ToyVocab.EOS, ToyVocab.CALL, ToyVocab.END_CALL


@pytest.mark.parametrize(
    ("digit", "reply", "reward"),
    [
        (4, [D(0), D(2), D(8), EOS], 1.0),  # all even
        (4, [D(1), D(2), 40, EOS], 1 / 3),  # one even digit out of three content tokens
        (7, [D(1), D(3), D(5), D(9)], 1.0),
        (7, [D(2), 30], 0.0),
        (7, [EOS], 0.0),  # empty reply
    ],
)
def test_same_parity_reward(digit: int, reply: list[int], reward: float) -> None:
    assert same_parity_reward(copy_digit_prompt(0, digit), reply) == pytest.approx(reward)


def _episode(a: int, b: int, turns: list[list[int]]) -> env_mod.EpisodeOutcome:
    env = env_mod.ToolAddEnv(max_turns=4)
    prompt = tool_add_prompt(0, a, b)
    state = env.start(prompt)
    for ids in turns:
        if env.step(prompt, state, ids, "stop").done:
            break
    return env.score(prompt, state, turns)


@pytest.mark.parametrize(
    ("turns", "reward", "success"),
    [
        ([[CALL, 30, 31]], 0.1, False),  # called, not closed, no digit argument
        ([[CALL, D(3), 31, END]], 0.1 + 0.1 + 0.05, False),  # closed, one digit argument
        ([[CALL, D(3), D(4), D(5), END]], 0.1 + 0.1 + 0.1, False),  # two digit arguments but three arguments
        ([[CALL, D(3), D(4), END], [D(7), EOS]], 1.0, True),  # the protocol, right answer
        ([[CALL, D(3), D(4), END], [D(6), EOS]], 0.1 + 0.1 + 0.1 + 0.1 + 0.1, False),  # wrong answer
        # right answer after a malformed call: most of the shaped reward, not a success (the call failed)
        ([[CALL, D(3), END], [D(7), EOS]], 0.1 + 0.1 + 0.05 + 0.1 + 0.5, False),
        ([[D(7), EOS]], 0.0, False),  # an answer without a call earns nothing
    ],
)
def test_tool_add_shaped_reward_and_success(turns: list[list[int]], reward: float, success: bool) -> None:
    outcome = _episode(3, 4, turns)
    assert outcome.reward == pytest.approx(reward) and outcome.success is success


ERR, SEP = ToyVocab.ERR, ToyVocab.SEP


@pytest.mark.parametrize(
    ("turns", "appended", "reward"),
    [
        ([[D(5), EOS]], [], 1.0),  # right at the first guess
        ([[D(3), EOS], [D(5), EOS]], [[ERR, SEP]], 1 / 2),  # the shown digit 3 is not the hidden 5
        ([[30, D(1), D(5), EOS], [D(5)]], [[ERR, SEP]], 1 / 2),  # a turn's FIRST digit is its guess
        ([[30, EOS], [D(2), D(5)], [D(5), EOS]], [[ERR, SEP], [ERR, SEP]], 1 / 3),  # no digit: a wasted turn
        ([[EOS], [D(5), EOS]], [[ERR, SEP]], 1 / 2),  # an empty turn is answered too
        (
            [[D(1)], [D(2)], [D(3)], [D(4)]],
            [[ERR, SEP]] * 3,
            0.0,
        ),  # four misses: max_turns, no answer after the last
        (
            [[D(1), D(5), EOS], [EOS, D(5)]] + [[D(1)]] * 2,
            [[ERR, SEP]] * 3,
            0.0,
        ),  # digits after EOS do not count
    ],
)
def test_retry_digit_episode(turns: list[list[int]], appended: list[list[int]], reward: float) -> None:
    env = env_mod.RetryDigitEnv(max_turns=4)
    prompt = env_mod.retry_digit_prompt(0, shown=3, target=5)
    assert prompt.input_ids == [ToyVocab.BOS, D(3), SEP] and prompt.meta == {"digit": 3, "target": 5}
    state = env.start(prompt)
    got = []
    for i, ids in enumerate(turns):
        step = env.step(prompt, state, ids, "stop")
        assert step.done == (i == len(turns) - 1)  # each case's last turn ends it, no earlier one does
        got.append(step.append_ids)
    outcome = env.score(prompt, state, turns)
    assert got[:-1] == appended[: len(turns) - 1] and got[-1] == []
    assert outcome.reward == pytest.approx(reward) and outcome.num_turns == len(turns)
    assert outcome.success is (reward > 0)  # success: some turn guessed the hidden digit


def test_retry_digit_prompts_hide_the_shown_digit_in_60_percent() -> None:
    from rlfleet.trainer.envs.prompts import GeneratedPromptSource

    source = GeneratedPromptSource("retry_digit", seed=3)
    prompts = [source.get(i) for i in range(4000)]
    assert prompts[17].meta == GeneratedPromptSource("retry_digit", seed=3).get(17).meta  # a pure function
    same = sum(p.meta["target"] == p.meta["digit"] for p in prompts) / len(prompts)
    assert abs(same - (0.6 + 0.4 * 0.1)) < 0.025  # shown with prob 0.6, else uniform (shown 1 time in 10)
    assert {p.meta["target"] for p in prompts} == set(range(10))
    assert all(p.input_ids == [ToyVocab.BOS, D(p.meta["digit"]), SEP] for p in prompts)
