"""Environments: what turns a model's sampled tokens into a reward (and, multi-turn, into more turns).

Two shapes, both user-pluggable by an entry point "module:attr" (`rollout.environment` in the RLJob):
- a single-turn reward function `fn(prompt: Prompt, completion_ids: list[int]) -> float`, wrapped in
  `RewardFunctionEnv`;
- a multi-turn `Environment` (subclass or instance): after every model turn `step()` either ends the
  episode or returns the environment's tokens to append (as ids, loss mask 0: nothing is ever
  detokenised and re-tokenised, so the trainer scores exactly the ids the sampler produced).

Built-in toy tasks live on a tiny fixed vocabulary (`ToyVocab`, >= 32 ids) so that a randomly
initialised tiny Qwen3 (rlfleet/tiny_qwen3.py) can learn them on CPU in minutes and every reward is exactly verifiable:
- `copy_digit` (single turn): the prompt names a digit d; reward = share of the reply's tokens equal
  to d (a constant-digit policy earns only 0.1, so the task needs attention to the prompt).
- `same_parity` (single turn): the same prompts; reward = share of the reply's tokens that are digits
  of d's parity (five right answers per position: an optimum that keeps entropy; a policy ignoring the
  prompt earns 0.5).
- `retry_digit` (multi turn): guess the prompt's hidden digit, retrying after a wrong guess; the
  hidden digit is the shown one for ~64% of prompts and unrelated to it for the rest, so even the
  optimal policy fails its first guess on ~36% of prompts and must explore (an optimum that keeps
  entropy, and failing episodes are the longer ones: see `RetryDigitEnv`).
- `tool_add` (multi turn): the prompt holds two digits a, b; the model calls the tool
  `CALL x y END_CALL`, the environment answers `RESULT (x+y)%10 END_RESULT`, and the model must then
  reply with the digit (a+b)%10 and EOS (shaped reward, see `ToolAddEnv.score`). Episodes end on an answer, on `max_turns`, or after
  `max_turns_without_tool` consecutive turns without a tool call (method.md's collapse precursor).

For real models (a tokenizer with a chat template): `MathEnv` (final-answer check, reward 1/0) and
`ChatTurnEncoder`, which turns an environment message (a tool result) into the ids to append after
the model's turn, so a multi-turn history is never re-rendered. docs/environments.md documents the
plugin interface with a worked example.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.trainer.envs.prompts import Prompt


class ToyVocab:
    """Token ids of the built-in toy tasks. Ids >= FIRST_FILLER are meaningless filler tokens."""

    PAD = 0
    BOS = 1
    EOS = 2
    SEP = 3  # end of prompt / start of the reply
    CALL = 4  # tool call opens
    END_CALL = 5  # tool call closes (a stop token: the environment answers)
    RESULT = 6  # tool result opens (environment tokens only)
    END_RESULT = 7
    ERR = 8  # tool result for a malformed call
    DIGIT0 = 10  # digits 0..9 are ids 10..19
    FIRST_FILLER = 20
    MIN_VOCAB = 32

    @classmethod
    def digit(cls, d: int) -> int:
        return cls.DIGIT0 + int(d) % 10

    @classmethod
    def is_digit(cls, token_id: int) -> bool:
        return cls.DIGIT0 <= token_id < cls.DIGIT0 + 10

    @classmethod
    def value(cls, token_id: int) -> int:
        return token_id - cls.DIGIT0


@dataclass
class EnvStep:
    """The environment's answer to one model turn."""

    done: bool
    append_ids: list[int] = field(default_factory=list)  # env tokens to append (loss mask 0) if not done
    tool_call: bool = False  # this turn contained a (well- or malformed) tool call
    format_error: bool = False  # this turn was malformed (bad tool call, no parsable answer)


@dataclass
class EpisodeOutcome:
    """Scored once per trajectory, when the episode ends."""

    reward: float
    num_turns: int
    empty_final_reply: bool  # the last model turn produced no token other than EOS
    no_tool_call_termination: bool  # ended because of `max_turns_without_tool`
    format_errors: int
    tool_calls: int
    success: bool | None = None  # the task was solved (the environment's own test); None: it has none
    # the graded patch touched test files or test configuration (SweEnv: restored before grading, a
    # reward-hacking precursor); None: nothing was graded or the environment has no such notion
    touched_test_infra: bool | None = None
    details: dict[str, Any] = field(
        default_factory=dict
    )  # environment-specific (SweEnv: reason, sandbox time)


class Environment:
    """Multi-turn environment. Subclass and override `step` and `score`.

    `state` is a per-episode dict owned by the environment; the rollout driver keeps it with the
    trajectory and passes it back. `stop_token_ids` end a model turn early (e.g. END_CALL).
    """

    max_turns: int = 1
    stop_token_ids: tuple[int, ...] = ()

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {}

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        return EnvStep(done=True)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        raise NotImplementedError


RewardFn = Callable[[Prompt, list[int]], float]


class RewardFunctionEnv(Environment):
    """A single-turn environment around a reward function `fn(prompt, completion_ids) -> float`."""

    max_turns = 1

    def __init__(self, fn: RewardFn, stop_token_ids: Sequence[int] = (ToyVocab.EOS,)) -> None:
        self.fn = fn
        self.stop_token_ids = tuple(stop_token_ids)

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        return EnvStep(done=True)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        reply = replies[-1] if replies else []
        content = [t for t in reply if t != ToyVocab.EOS]
        return EpisodeOutcome(
            reward=float(self.fn(prompt, list(reply))),
            num_turns=len(replies),
            empty_final_reply=len(content) == 0,
            no_tool_call_termination=False,
            format_errors=0,
            tool_calls=0,
        )


# ---------------------------------------------------------------------------------------------
# Built-in toy tasks


def _strip_eos(ids: Sequence[int]) -> list[int]:
    out: list[int] = []
    for t in ids:
        if t == ToyVocab.EOS:
            break
        out.append(int(t))
    return out


def copy_digit_reward(prompt: Prompt, completion_ids: list[int]) -> float:
    """Share of reply tokens (before EOS) equal to the prompt's digit."""
    target = ToyVocab.digit(int(prompt.meta["digit"]))
    content = _strip_eos(completion_ids)
    if not content:
        return 0.0
    score = sum(1.0 if t == target else 0.0 for t in content)
    return score / len(content)


def same_parity_reward(prompt: Prompt, completion_ids: list[int]) -> float:
    """Share of reply tokens (before EOS) that are digits of the prompt digit's parity: five correct
    tokens at every position, so the optimum does not have to be deterministic (entropy up to ln 5)."""
    parity = int(prompt.meta["digit"]) % 2
    content = _strip_eos(completion_ids)
    if not content:
        return 0.0
    return sum(1.0 for t in content if ToyVocab.is_digit(t) and ToyVocab.value(t) % 2 == parity) / len(
        content
    )


def copy_digit_prompt(index: int, rng_digit: int) -> Prompt:
    d = int(rng_digit) % 10
    return Prompt(index=index, input_ids=[ToyVocab.BOS, ToyVocab.digit(d), ToyVocab.SEP], meta={"digit": d})


class ToolAddEnv(Environment):
    """Multi-turn tool use: call `CALL x y END_CALL`, read `RESULT s END_RESULT`, answer `s EOS`."""

    stop_token_ids = (ToyVocab.EOS, ToyVocab.END_CALL)

    def __init__(self, max_turns: int = 4, max_turns_without_tool: int = 3) -> None:
        self.max_turns = max_turns
        self.max_turns_without_tool = max_turns_without_tool

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {
            "turns": 0,
            "turns_without_tool": 0,
            "tool_calls": 0,
            "format_errors": 0,
            "answer": None,
            "no_tool_end": False,
            "used_result": None,
            "closed_calls": 0,
            "digit_args": 0,
        }

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        state["turns"] += 1
        ids = [int(t) for t in output_ids]
        if ToyVocab.CALL in ids:
            state["tool_calls"] += 1
            state["turns_without_tool"] = 0
            args = ids[ids.index(ToyVocab.CALL) + 1 :]
            if ids[-1] == ToyVocab.END_CALL:
                state["closed_calls"] += 1
            if args and args[-1] == ToyVocab.END_CALL:
                args = args[:-1]
            state["digit_args"] = max(state["digit_args"], sum(ToyVocab.is_digit(t) for t in args[:2]))
            well_formed = (
                len(args) == 2 and all(ToyVocab.is_digit(t) for t in args) and ids[-1] == ToyVocab.END_CALL
            )
            if well_formed:
                s = (ToyVocab.value(args[0]) + ToyVocab.value(args[1])) % 10
                state["used_result"] = s
                result = [ToyVocab.RESULT, ToyVocab.digit(s), ToyVocab.END_RESULT]
            else:
                state["format_errors"] += 1
                result = [ToyVocab.RESULT, ToyVocab.ERR, ToyVocab.END_RESULT]
            done = state["turns"] >= self.max_turns
            return EnvStep(
                done=done, append_ids=[] if done else result, tool_call=True, format_error=not well_formed
            )
        state["turns_without_tool"] += 1
        content = _strip_eos(ids)
        digits = [t for t in content if ToyVocab.is_digit(t)]
        if digits and ids and ids[-1] == ToyVocab.EOS:
            state["answer"] = ToyVocab.value(digits[-1])
            return EnvStep(done=True)
        if state["turns_without_tool"] >= self.max_turns_without_tool:
            state["no_tool_end"] = True
            return EnvStep(done=True, format_error=bool(content))
        done = state["turns"] >= self.max_turns
        # No answer and no call: nudge the model with an empty tool result so the turn structure holds.
        return EnvStep(done=done, append_ids=[] if done else [ToyVocab.SEP], format_error=bool(content))

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        """Shaped so that a random tiny model gets signal from step 0 and every step of the protocol has
        its own gradient (no plateau where all samples score alike), each part exactly checkable:
        0.1 for calling the tool, +0.1 if a call was closed by END_CALL, +0.05 per digit among a call's
        first two arguments (best call), +0.1 if a call was well formed (exactly two digit arguments),
        +0.1 for answering with a digit and EOS after a call, +0.5 if that answer is (a + b) % 10.
        Maximum 1.0. Success (not shaped): a well-formed call and then the answer (a + b) % 10."""
        truth = (int(prompt.meta["a"]) + int(prompt.meta["b"])) % 10
        reward = 0.0
        if state["tool_calls"] > 0:
            reward += 0.1
        if state["closed_calls"] > 0:
            reward += 0.1
        reward += 0.05 * state.get("digit_args", 0)
        if state["used_result"] is not None:
            reward += 0.1
        if state["tool_calls"] > 0 and state["answer"] is not None:
            reward += 0.1 + (0.5 if state["answer"] == truth else 0.0)
        last = replies[-1] if replies else []
        return EpisodeOutcome(
            reward=reward,
            num_turns=len(replies),
            empty_final_reply=len(_strip_eos(last)) == 0,
            no_tool_call_termination=bool(state["no_tool_end"]),
            format_errors=int(state["format_errors"]),
            tool_calls=int(state["tool_calls"]),
            success=state["used_result"] is not None and state["answer"] == truth,
        )


class RetryDigitEnv(Environment):
    """Guess the hidden digit, with retries: each model turn's first digit token (before EOS) is its
    guess; a right guess ends the episode, a wrong one (or a turn without a digit) is answered
    `ERR SEP` and the model guesses again, up to `max_turns` turns. Reward 1/t when turn t guessed
    right, 0 if none did.

    The prompt shows a digit d (`retry_digit_prompt`); the hidden digit (`meta["target"]`) is d for
    60% of prompts and a uniformly random digit for the rest (also d a tenth of the time), drawn by the
    prompt generator. The best policy guesses d, then the other digits without repeating: reward about
    0.64 + 0.04 (1/2 + 1/3 + 1/4) = 0.68; a policy ignoring the prompt earns at most 0.1 (1 + 1/2 + 1/3
    + 1/4) = 0.21 (chance). Why it exists (docs/ablation.md): not all its groups can become uniform (a
    third of the prompts fail the first guess under any policy, and their samples differ while the
    retries keep entropy; the others do), its optimum is stochastic after a miss,
    and its failing episodes are its long ones, so the conditional mean advantage of late-turn
    contexts stays negative: the regime where uncorrected policy gradient's drift term
    (docs/objective.md) is not switched off by a deterministic policy."""

    stop_token_ids = (ToyVocab.EOS,)
    RETRY_IDS = (ToyVocab.ERR, ToyVocab.SEP)

    def __init__(self, max_turns: int = 4) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.max_turns = max_turns

    def start(self, prompt: Prompt) -> dict[str, Any]:
        return {"turns": 0, "solved_at": None, "format_errors": 0}

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        state["turns"] += 1
        digits = [t for t in _strip_eos(output_ids) if ToyVocab.is_digit(t)]
        if not digits:
            state["format_errors"] += 1
        elif ToyVocab.value(digits[0]) == int(prompt.meta["target"]):
            state["solved_at"] = state["turns"]
            return EnvStep(done=True)
        done = state["turns"] >= self.max_turns
        return EnvStep(done=done, append_ids=[] if done else list(self.RETRY_IDS), format_error=not digits)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        solved = state["solved_at"]
        last = replies[-1] if replies else []
        return EpisodeOutcome(
            reward=0.0 if solved is None else 1.0 / solved,
            num_turns=len(replies),
            empty_final_reply=len(_strip_eos(last)) == 0,
            no_tool_call_termination=False,
            format_errors=int(state["format_errors"]),
            tool_calls=0,
            success=solved is not None,
        )


def retry_digit_prompt(index: int, shown: int, target: int) -> Prompt:
    """`BOS shown SEP`; the hidden `target` is only in meta (the environment's answer key)."""
    return Prompt(
        index=index,
        input_ids=[ToyVocab.BOS, ToyVocab.digit(shown), ToyVocab.SEP],
        meta={"digit": int(shown) % 10, "target": int(target) % 10},
    )


def tool_add_prompt(index: int, a: int, b: int) -> Prompt:
    return Prompt(
        index=index,
        input_ids=[ToyVocab.BOS, ToyVocab.digit(a), ToyVocab.digit(b), ToyVocab.SEP],
        meta={"a": int(a) % 10, "b": int(b) % 10},
    )


# ---------------------------------------------------------------------------------------------
# Real models: chat turns as token ids, and the math final-answer environment


def _ids(out: Any) -> list[int]:
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


def _find(seq: list[int], sub: list[int], start: int = 0, last: bool = False) -> int:
    """Index of the first (or last) occurrence of `sub` in `seq` at or after `start`; -1 if none."""
    hits = [i for i in range(start, len(seq) - len(sub) + 1) if seq[i : i + len(sub)] == sub]
    return (hits[-1] if last else hits[0]) if hits else -1


class ChatTurnEncoder:
    """Token-in / token-out multi-turn with a chat template: the ids to APPEND after a model turn for
    an environment message (a tool result, a user follow-up), ending with the generation prompt of
    the next assistant turn. The history is never re-rendered.

    The template is probed once on a fixed chat (user "1", assistant "0"): the assistant turn's
    end-of-turn id is the first id after its content (`<|im_end|>` in ChatML, whatever the template
    uses otherwise, not necessarily the tokenizer's EOS). For a message, the chat + the message is
    rendered and the ids after the probe assistant's end-of-turn are taken. Only ids AFTER the
    assistant turn are used, so templates that render a past assistant turn differently from the
    last one (Qwen3 drops the empty think block of earlier turns) still give the right ids, and the
    model's own ids stay exactly as sampled. A turn that did not end with the end-of-turn id (cut by
    the length budget) is closed with it first."""

    USER = {"role": "user", "content": "1"}
    ASSISTANT = {"role": "assistant", "content": "0"}

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatTurnEncoder needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        gen = _ids(tokenizer.apply_chat_template([self.USER], tokenize=True, add_generation_prompt=True))
        done = _ids(tokenizer.apply_chat_template([self.USER, self.ASSISTANT], tokenize=True))
        self._content = _ids(tokenizer.encode(self.ASSISTANT["content"], add_special_tokens=False))
        at = _find(done, self._content, start=len(gen) - 1, last=True) if done[: len(gen)] == gen else -1
        if at < 0 or at + len(self._content) >= len(done):
            raise ValueError(
                "the chat template does not render an assistant turn as its content + an end-of-turn token"
            )
        self.end_of_turn_id = int(done[at + len(self._content)])
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys([self.end_of_turn_id, *([int(eos)] if eos is not None else [])])
        )

    def message_ids(self, content: str, role: str = "tool") -> list[int]:
        """Ids that follow the model's end-of-turn id for one `role` message."""
        gen_len = len(
            _ids(self.tokenizer.apply_chat_template([self.USER], tokenize=True, add_generation_prompt=True))
        )
        full = _ids(
            self.tokenizer.apply_chat_template(
                [self.USER, self.ASSISTANT, {"role": role, "content": content}],
                tokenize=True,
                add_generation_prompt=True,
            )
        )
        at = _find(full, [*self._content, self.end_of_turn_id], start=gen_len - 1)
        if at < 0:
            raise ValueError(f"the chat template does not render a {role!r} message after an assistant turn")
        return full[at + len(self._content) + 1 :]

    def append_ids(self, output_ids: Sequence[int], content: str, role: str = "tool") -> list[int]:
        """Ids to append after the model turn `output_ids` (closing it if the model did not)."""
        closed = bool(output_ids) and int(output_ids[-1]) == self.end_of_turn_id
        return ([] if closed else [self.end_of_turn_id]) + self.message_ids(content, role)


def chat_stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a model turn: the chat template's end-of-turn id (if it has a template) and EOS."""
    if getattr(tokenizer, "chat_template", None):
        return ChatTurnEncoder(tokenizer).stop_token_ids
    return (int(tokenizer.eos_token_id),)


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """The reply's final answer: the last `\\boxed{}`, else the number after the last `####`, else the
    last number in the text; None when there is none (a format error)."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    marks = re.findall(r"####\s*(" + _NUMBER + ")", text)
    if marks:
        return marks[-1]
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    t = re.sub(r"^\\(?:d?frac)\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", t)
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            return float(num) / float(den)
        return float(t)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(given: str, truth: str) -> bool:
    """Numerically equal (1e-6 relative; "1,000" == "1000.0" == "\\frac{2000}{2}"), else equal as
    whitespace-free strings."""
    a, b = _as_number(given), _as_number(truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return re.sub(r"\s+", "", given) == re.sub(r"\s+", "", truth)


class MathEnv(Environment):
    """Single-turn math with a verifiable final answer: reward 1 when the reply's final answer
    (`extract_final_answer`) equals the prompt's `meta["answer"]` (a GSM8K-style "... #### 42" answer
    is reduced to its final number), else 0; a reply without any parsable answer is a format error.
    Needs the model's tokenizer (to read the reply's text; the ids themselves are never re-encoded).
    Entry point: `rlfleet.trainer.envs.environments:MathEnv`."""

    max_turns = 1

    def __init__(self, tokenizer: Any = None, answer_key: str = "answer") -> None:
        if tokenizer is None:
            raise ValueError("MathEnv needs the model's tokenizer (to read the replies)")
        self.tokenizer = tokenizer
        self.answer_key = answer_key
        self.stop_token_ids = chat_stop_ids(tokenizer)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        if self.answer_key not in prompt.meta:
            raise KeyError(
                f"prompt {prompt.prompt_id} has no {self.answer_key!r} (a column of the prompt set)"
            )
        given = str(prompt.meta[self.answer_key])
        truth = extract_final_answer(given) if "####" in given else given
        reply = replies[-1] if replies else []
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        answer = extract_final_answer(text)
        correct = answer is not None and truth is not None and answers_match(answer, truth)
        return EpisodeOutcome(
            reward=1.0 if correct else 0.0,
            num_turns=len(replies),
            empty_final_reply=not text.strip(),
            no_tool_call_termination=False,
            format_errors=1 if answer is None else 0,
            tool_calls=0,
            success=correct,
        )


copy_digit = RewardFunctionEnv(copy_digit_reward)
same_parity = RewardFunctionEnv(same_parity_reward)
tool_add = ToolAddEnv()
retry_digit = RetryDigitEnv()

BUILTIN: dict[str, str] = {
    "copy_digit": "rlfleet.trainer.envs.environments:copy_digit",
    "same_parity": "rlfleet.trainer.envs.environments:same_parity",
    "tool_add": "rlfleet.trainer.envs.environments:tool_add",
    "retry_digit": "rlfleet.trainer.envs.environments:retry_digit",
    "math": "rlfleet.trainer.envs.environments:MathEnv",
}


class EnvironmentLoadError(ValueError):
    """The environment entry point cannot be resolved (clear, one line)."""


def load_environment(entry_point: str, tokenizer: Any = None, **options: Any) -> Environment:
    """Resolve "module:attr" (or a built-in name) to an Environment.

    attr may be an Environment instance, an Environment subclass (instantiated with `options`, plus
    the model's `tokenizer` when its constructor takes one), or a reward function of (prompt,
    completion_ids) (wrapped single-turn).
    """
    target = BUILTIN.get(entry_point, entry_point)
    if ":" not in target:
        raise EnvironmentLoadError(
            f"environment {entry_point!r}: expected 'module:attr' or one of {sorted(BUILTIN)}"
        )
    module_name, attr = target.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(
            f"environment {entry_point!r}: cannot import {module_name!r}: {exc}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvironmentLoadError(
                f"environment {entry_point!r}: {module_name!r} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    if isinstance(obj, Environment):
        return obj
    if inspect.isclass(obj) and issubclass(obj, Environment):
        if "tokenizer" in inspect.signature(obj.__init__).parameters:
            options = {"tokenizer": tokenizer, **options}
        try:
            return obj(**options)
        except (TypeError, ValueError) as exc:
            raise EnvironmentLoadError(f"environment {entry_point!r}: {exc}") from None
    if callable(obj):
        return RewardFunctionEnv(obj)
    raise EnvironmentLoadError(
        f"environment {entry_point!r}: {attr!r} is neither an Environment nor callable"
    )
