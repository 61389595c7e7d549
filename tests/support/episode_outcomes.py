"""`EpisodeOutcome`s of the test environments' and the tests' own episodes."""

from __future__ import annotations

from typing import Any

from rlfleet.trainer.envs.environments import EpisodeOutcome


def finished_outcome(reward: float, num_turns: int, tool_calls: int, **fields: Any) -> EpisodeOutcome:
    """An episode that ended as planned: its final reply not empty, not cut off for want of a tool call,
    no format error; `fields` sets the rest (success, touched_test_infra, details)."""
    return EpisodeOutcome(
        reward=reward,
        num_turns=num_turns,
        empty_final_reply=False,
        no_tool_call_termination=False,
        format_errors=0,
        tool_calls=tool_calls,
        **fields,
    )
