"""Rewards of the built-in toy tasks, exact (hand-computed expectations)."""

from __future__ import annotations

import pytest

from rlfleet.trainer import environments as env_mod
from rlfleet.trainer.environments import ToyVocab, copy_digit_prompt, same_parity_reward, tool_add_prompt

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


def _episode(a: int, b: int, turns: list[list[int]]) -> float:
    env = env_mod.ToolAddEnv(max_turns=4)
    prompt = tool_add_prompt(0, a, b)
    state = env.start(prompt)
    for ids in turns:
        if env.step(prompt, state, ids, "stop").done:
            break
    return env.score(prompt, state, turns).reward


@pytest.mark.parametrize(
    ("turns", "reward"),
    [
        ([[CALL, 30, 31]], 0.1),  # called, not closed, no digit argument
        ([[CALL, D(3), 31, END]], 0.1 + 0.1 + 0.05),  # closed, one digit argument
        ([[CALL, D(3), D(4), D(5), END]], 0.1 + 0.1 + 0.1),  # two digit arguments but three arguments
        ([[CALL, D(3), D(4), END], [D(7), EOS]], 1.0),  # the protocol, right answer
        ([[CALL, D(3), D(4), END], [D(6), EOS]], 0.1 + 0.1 + 0.1 + 0.1 + 0.1),  # wrong answer
        ([[CALL, D(3), END], [D(7), EOS]], 0.1 + 0.1 + 0.05 + 0.1 + 0.5),  # right answer after a malformed call
        ([[D(7), EOS]], 0.0),  # an answer without a call earns nothing
    ],
)
def test_tool_add_shaped_reward(turns: list[list[int]], reward: float) -> None:
    assert _episode(3, 4, turns) == pytest.approx(reward)
