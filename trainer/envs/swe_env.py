"""The SWE environment: an agent fixes a bug in a repository with tools, and earns 1 only if the
task's hidden tests pass in a FRESH sandbox built from the snapshot + its submitted diff (the
working sandbox never grades itself). Entry point `rlfleet.trainer.envs.swe_env:SweEnv`; the protocol,
the limits and what the sandbox isolates are in docs/environments.md 'The SWE environment'.

Token-in / token-out like every multi-turn environment (trainer/envs/environments.py): the prompt (the
system message with the tool protocol + the task statement) is rendered by the model's chat
template once; every tool result is a `tool` message whose ids `ChatTurnEncoder` appends after the
model's turn. A model turn calls at most one tool, Hermes/Qwen style:
    <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from rlfleet.trainer.envs.environments import ChatTurnEncoder, Environment, EnvStep, EpisodeOutcome
from rlfleet.trainer.envs.prompts import Prompt, render_chat_prompt
from rlfleet.trainer.envs.swe_grade import (
    GradeResult,
    git_apply,
    grading_plan,
    is_test_infrastructure,
    new_nonce,
    parse_report,
    restore_test_infrastructure,
    runner_command,
    test_framework,
    test_name_error,
    verdict,
)

OUTPUT_HEAD_CHARS = 4_000  # a tool result keeps the first and the last 4,000 characters of the output
OUTPUT_TAIL_CHARS = 4_000
DEFAULT_COMMAND_TIMEOUT_S = 30.0
MAX_COMMAND_TIMEOUT_S = 120.0

SYSTEM_PROMPT = """You fix bugs in a Python repository (your working directory, /work).
Call exactly one tool per reply, as JSON inside tags:
<tool_call>{"name": "bash", "arguments": {"command": "python3 -m unittest -q", "timeout": 30}}</tool_call>
Tools:
- bash(command, timeout=30): run a shell command (no network; at most 120 s); you get its exit code and output (the first and last 4000 characters).
- edit(path, old, new): replace the one occurrence of `old` in the file with `new`.
- write(path, content): write a whole file.
- submit(): end the episode; your changes are graded by hidden tests in a fresh copy of the repository.
Test files and test configuration are restored before grading: changing them changes nothing. Three replies in a row without a tool call end the episode."""

NO_TOOL_MESSAGE = "No tool call found. Call one tool (bash, edit, write) or submit()."
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def truncate_output(text: str) -> str:
    """The rule the system prompt states: beyond 8,000 characters, the first and last 4,000."""
    if len(text) <= OUTPUT_HEAD_CHARS + OUTPUT_TAIL_CHARS:
        return text
    omitted = len(text) - OUTPUT_HEAD_CHARS - OUTPUT_TAIL_CHARS
    return f"{text[:OUTPUT_HEAD_CHARS]}\n[... {omitted} characters omitted ...]\n{text[-OUTPUT_TAIL_CHARS:]}"


def _names(value: Any, what: str) -> tuple[str, ...]:
    """Test names: a list of strings (absent: none)."""
    if value is None:
        return ()
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(f"{what}: expected a list of test names (strings)")


def _file_map(value: Any, what: str) -> dict[str, str]:
    """Files as a list of {"path", "content"} (a shape `datasets` keeps across rows) or a mapping."""
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    if isinstance(value, list) and all(
        isinstance(f, Mapping) and {"path", "content"} <= set(f) for f in value
    ):
        return {str(f["path"]): str(f["content"]) for f in value}
    raise ValueError(f"{what}: expected a list of {{'path', 'content'}} objects")


@dataclass(frozen=True)
class SweTask:
    """One task: a repository snapshot with a planted bug, its statement, and the hidden tests that
    the grader adds to the fresh sandbox (never shown to the agent): whole files (`hidden_tests`)
    and/or a diff (`test_patch`, SWE-bench's), applied after the agent's diff. `image`: the
    repository lives in this container image instead of `files` (a cluster sandbox's; the local
    sandbox refuses it). `fail_to_pass` / `pass_to_pass`: the unittest names that must each be
    reported run and passed (SWE-bench's); without them, every test of the hidden test files."""

    instance_id: str
    statement: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    test_command: str
    test_timeout_s: float = 60.0
    test_patch: str = ""
    image: str | None = None
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SweTask:
        missing = [
            k for k in ("instance_id", "statement", "files", "hidden_tests", "test_command") if k not in row
        ]
        if missing:
            raise ValueError(f"an SWE task needs {missing}")
        framework = test_framework(str(row["test_command"]))
        if framework is None:  # the grader runs the tests itself, with this framework's runner
            raise ValueError(
                f"test_command {row['test_command']!r} runs neither `python3 -m unittest` nor `pytest`"
            )
        names = [
            *_names(row.get("fail_to_pass"), "fail_to_pass"),
            *_names(row.get("pass_to_pass"), "pass_to_pass"),
        ]
        if errors := [e for n in names if (e := test_name_error(n, framework)) is not None]:
            raise ValueError(errors[0])
        return cls(
            instance_id=str(row["instance_id"]),
            statement=str(row["statement"]),
            files=_file_map(row["files"], "files"),
            hidden_tests=_file_map(row["hidden_tests"], "hidden_tests"),
            test_command=str(row["test_command"]),
            test_timeout_s=float(row.get("test_timeout_s") or 60.0),
            test_patch=str(row.get("test_patch") or ""),
            image=str(row["image"]) if row.get("image") else None,
            fail_to_pass=_names(row.get("fail_to_pass"), "fail_to_pass"),
            pass_to_pass=_names(row.get("pass_to_pass"), "pass_to_pass"),
        )

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.statement}]

    def row(self) -> dict[str, Any]:
        """The JSONL row (also a prompt-set row: `messages` is its prompt column)."""
        return {
            "instance_id": self.instance_id,
            "statement": self.statement,
            "messages": self.messages(),
            "files": [{"path": p, "content": c} for p, c in sorted(self.files.items())],
            "hidden_tests": [{"path": p, "content": c} for p, c in sorted(self.hidden_tests.items())],
            "test_command": self.test_command,
            "test_timeout_s": self.test_timeout_s,
            # only when set: a task file of snapshot tasks keeps its columns (and its bytes)
            **({"test_patch": self.test_patch} if self.test_patch else {}),
            **({"image": self.image} if self.image else {}),
            **({"fail_to_pass": list(self.fail_to_pass)} if self.fail_to_pass else {}),
            **({"pass_to_pass": list(self.pass_to_pass)} if self.pass_to_pass else {}),
        }

    def hidden_paths(self) -> set[str]:
        """The files the grader adds or changes: the agent may not touch them."""
        return set(self.hidden_tests) | set(diff_paths(self.test_patch))


def load_tasks(path: str | Path) -> list[SweTask]:
    """Tasks from a JSONL file (one `SweTask.row()` a line); errors name the line."""
    tasks = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tasks.append(SweTask.from_row(json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
    return tasks


def diff_paths(diff: str) -> list[str]:
    """The paths a git diff touches (both sides of every `diff --git a/X b/Y` header): a path with a
    space (`a/te st b/te st`, the two sides equal without renames) and a C-quoted one (`"a/\\303\\251"`,
    git's form for unusual bytes) included."""
    paths: list[str] = []
    for line in diff.splitlines():
        if not line.startswith("diff --git "):
            continue
        rest = line[len("diff --git ") :]
        quoted = re.fullmatch(r'("(?:[^"\\]|\\.)*"|\S+) ("(?:[^"\\]|\\.)*"|\S+)', rest)
        half = (len(rest) - 1) // 2
        if rest[:half].startswith("a/") and rest[half:] == " b/" + rest[2:half]:
            sides = [rest[2:half], rest[2:half]]
        elif quoted is not None:
            sides = [_unquote(q)[2:] for q in quoted.groups()]
        else:
            continue
        paths += sides
    return list(dict.fromkeys(paths))


def _unquote(text: str) -> str:
    """git's C-quoted path (`"a/\\303\\251t\\303\\251.py"`) as text; an unquoted one as it is."""
    if not (text.startswith('"') and text.endswith('"')):
        return text
    # git's quoting is ASCII with C escapes (octal bytes): unicode_escape reads them as code points < 256
    raw = (
        text[1:-1]
        .encode("ascii", errors="backslashreplace")
        .decode("unicode_escape")
        .encode("latin-1", errors="replace")
    )
    return raw.decode("utf-8", errors="replace")


def parse_tool_call(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(call, None), (None, format error) or (None, None) when the reply calls no tool."""
    if "<tool_call>" not in text:
        return None, None
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return None, "a <tool_call> without its closing </tool_call>"
    if len(blocks) > 1:
        return None, f"{len(blocks)} tool calls in one reply; call one tool per reply"
    try:
        call = json.loads(blocks[0])
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not JSON ({exc.msg})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, 'a tool call is {"name": ..., "arguments": {...}}'
    args = call.get("arguments", {})
    if not isinstance(args, dict):
        return None, "the tool call's arguments must be an object"
    return {"name": call["name"], "arguments": args}, None


TOOL_ARGS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "bash": {"command": str},
    "edit": {"path": str, "old": str, "new": str},
    "write": {"path": str, "content": str},
    "submit": {},
}


def tool_arguments_error(call: dict[str, Any]) -> str | None:
    spec = TOOL_ARGS.get(call["name"])
    if spec is None:
        return f"unknown tool {call['name']!r}; the tools are {sorted(TOOL_ARGS)}"
    args = call["arguments"]
    for name, kind in spec.items():
        if not isinstance(args.get(name), kind):
            return f"{call['name']} needs {name!r} (a string)"
    timeout = args.get("timeout", DEFAULT_COMMAND_TIMEOUT_S)
    if call["name"] == "bash" and (not isinstance(timeout, (int, float)) or timeout <= 0):
        return "bash's timeout is a positive number of seconds"
    return None


@dataclass
class EpisodeState:
    task: SweTask
    sandbox: Sandbox | None
    turns: int = 0
    tool_calls: int = 0
    empty_replies: int = 0
    format_errors: int = 0
    no_tool_streak: int = 0
    no_tool_end: bool = False
    sandbox_seconds: float = 0.0
    reward: float = 0.0
    reason: str = "the episode ended without submit()"
    touched_test_infra: list[str] | None = None  # a graded patch's test files and configuration


SandboxFactory = Callable[[Mapping[str, str], SandboxLimits], Sandbox]


def require_local_snapshot(task: SweTask) -> None:
    """The local sandbox starts from the task's files; it cannot pull a container image."""
    if task.image is not None:
        raise SandboxUnavailable(
            f"task {task.instance_id!r}: its repository is the image {task.image!r}, and the local bwrap "
            "sandbox cannot pull images; give the task a local snapshot instead (repo_path: a git "
            "repository holding base_commit, or a directory)"
        )


def local_sandbox(files: Mapping[str, str], limits: SandboxLimits) -> Sandbox:
    from rlfleet.sandbox.local import LocalSandbox

    return LocalSandbox(files, limits)


class SweEnv(Environment):
    """Tools bash / edit / write / submit in a sandbox; reward 1 iff the hidden tests pass on the
    submitted diff in a fresh sandbox. Per-episode metrics in `EpisodeOutcome` (turns, tool calls,
    format errors, the no-tool-call ending, the last reply empty) and its `details` (empty replies,
    sandbox seconds, the reason for the reward)."""

    def __init__(
        self,
        tokenizer: Any = None,
        max_turns: int = 50,
        max_turns_without_tool: int = 3,
        limits: SandboxLimits | None = None,
        grade_timeout_s: float | None = None,
        sandbox: SandboxFactory = local_sandbox,
    ) -> None:
        if tokenizer is None:
            raise ValueError("SweEnv needs the model's tokenizer (with a chat template)")
        self.tokenizer = tokenizer
        self.turns = ChatTurnEncoder(tokenizer)
        self.stop_token_ids = self.turns.stop_token_ids
        self.max_turns = int(max_turns)
        self.max_turns_without_tool = int(max_turns_without_tool)
        self.limits = limits or SandboxLimits()
        self.grade_timeout_s = grade_timeout_s
        self.sandbox = sandbox

    def prompt(self, task: SweTask, index: int = 0) -> Prompt:
        """The task as the prompt source gives it: `messages` rendered once, the rest as meta."""
        row = task.row()
        messages = row.pop("messages")
        return Prompt(index=index, input_ids=render_chat_prompt(self.tokenizer, messages), meta=row)

    def start(self, prompt: Prompt) -> dict[str, Any]:
        task = SweTask.from_row(prompt.meta)
        if self.sandbox is local_sandbox:
            require_local_snapshot(task)
        elif task.image is not None:  # sandbox pods run the RLJob's one image (rollout.sandbox.image)
            raise SandboxUnavailable(
                f"task {task.instance_id!r}: its repository is the image {task.image!r}; sandbox pods run "
                "rollout.sandbox.image with the task's files copied in, not a task's own image: give the task "
                "a snapshot (repo_path)"
            )
        return {"episode": EpisodeState(task=task, sandbox=self.sandbox(task.files, self.limits))}

    def step(
        self, prompt: Prompt, state: dict[str, Any], output_ids: list[int], finish_reason: str
    ) -> EnvStep:
        ep: EpisodeState = state["episode"]
        ep.turns += 1
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        ep.empty_replies += int(not text.strip())
        call, error = parse_tool_call(text)
        if call is not None:
            error = tool_arguments_error(call)
        if call is None and error is None:
            ep.no_tool_streak += 1
            if ep.no_tool_streak >= self.max_turns_without_tool:
                ep.no_tool_end = True
                ep.reason = f"{self.max_turns_without_tool} replies in a row without a tool call"
                return self._end(ep)
            return self._reply(ep, output_ids, NO_TOOL_MESSAGE, tool_call=False)
        ep.no_tool_streak = 0
        ep.tool_calls += 1
        if error is not None:
            ep.format_errors += 1
            return self._reply(ep, output_ids, f"error: {error}", format_error=True)
        assert call is not None
        if call["name"] == "submit":
            self._grade(ep)
            return self._end(ep)
        return self._reply(ep, output_ids, self._run_tool(ep, call))

    def _reply(
        self,
        ep: EpisodeState,
        output_ids: list[int],
        content: str,
        tool_call: bool = True,
        format_error: bool = False,
    ) -> EnvStep:
        if ep.turns >= self.max_turns:  # the driver samples no more turns: close the sandbox now
            ep.reason = f"max_turns ({self.max_turns}) reached without submit()"
            return self._end(ep, tool_call=tool_call, format_error=format_error)
        append = self.turns.append_ids(output_ids, content, role="tool")
        return EnvStep(done=False, append_ids=append, tool_call=tool_call, format_error=format_error)

    def _end(self, ep: EpisodeState, tool_call: bool = True, format_error: bool = False) -> EnvStep:
        self._close(ep)
        return EnvStep(done=True, tool_call=tool_call and not ep.no_tool_end, format_error=format_error)

    def _close(self, ep: EpisodeState) -> None:
        if ep.sandbox is not None:
            ep.sandbox_seconds += ep.sandbox.seconds
            ep.sandbox.close()
            ep.sandbox = None

    def _run_tool(self, ep: EpisodeState, call: dict[str, Any]) -> str:
        assert ep.sandbox is not None
        args, box = call["arguments"], ep.sandbox
        try:
            if call["name"] == "bash":
                timeout = min(float(args.get("timeout", DEFAULT_COMMAND_TIMEOUT_S)), MAX_COMMAND_TIMEOUT_S)
                result = box.run(args["command"], timeout_s=timeout)
                status = (
                    f"timed out after {timeout:g} s" if result.timed_out else f"exit code {result.exit_code}"
                )
                return f"{status}\n{truncate_output(result.output)}"
            if call["name"] == "write":
                box.write_file(args["path"], args["content"])
                return f"wrote {len(args['content'])} characters to {args['path']}"
            return self._edit(box, args["path"], args["old"], args["new"])
        except OSError as exc:  # a tool error the agent can read (no such file, a read-only path)
            return f"error: {exc}"

    @staticmethod
    def _edit(box: Sandbox, path: str, old: str, new: str) -> str:
        text = box.read_file(path)
        count = text.count(old) if old else 0
        if count != 1:
            return f"error: `old` occurs {count} times in {path}; it must occur exactly once"
        box.write_file(path, text.replace(old, new, 1))
        return f"edited {path}"

    def _grade(self, ep: EpisodeState) -> None:
        """The submitted diff, applied in a fresh sandbox from the snapshot, graded by the hidden tests
        through the grader's own runner (trainer/envs/swe_grade.py)."""
        assert ep.sandbox is not None
        task, diff = ep.task, ep.sandbox.diff()
        self._close(ep)  # the working sandbox never grades itself
        if not diff.strip():
            ep.reason = "submitted an empty diff"
            return
        ep.touched_test_infra = [
            p for p in diff_paths(diff) if is_test_infrastructure(p, task.hidden_paths())
        ]
        fresh = self.sandbox(task.files, self.limits)
        try:
            result = self._run_hidden_tests(fresh, task, diff)
            ep.reward, ep.reason = result.reward, result.reason
        finally:
            ep.sandbox_seconds += fresh.seconds
            fresh.close()

    def _run_hidden_tests(self, fresh: Sandbox, task: SweTask, diff: str) -> GradeResult:
        code, output = git_apply(fresh, diff)
        if code != 0:
            return GradeResult(0.0, f"the patch does not apply: {output.strip()[-300:]}")
        problem = restore_test_infrastructure(fresh, task.files, task.hidden_tests, task.hidden_paths())
        if problem is not None:
            return GradeResult(0.0, problem)
        if task.test_patch:
            code, output = git_apply(fresh, task.test_patch)
            if code != 0:
                return GradeResult(0.0, f"the test patch does not apply: {output.strip()[-300:]}")
        framework = test_framework(task.test_command)
        if framework is None:
            return GradeResult(
                0.0, f"the task's test command {task.test_command!r} runs neither unittest nor pytest"
            )
        plan = grading_plan(
            task.files,
            task.hidden_tests,
            diff_paths(task.test_patch),
            [*task.fail_to_pass, *task.pass_to_pass],
            task.hidden_paths(),
            framework,
        )
        if not plan.names:
            return GradeResult(0.0, "the task has no hidden test module to run")
        nonce = new_nonce()
        config = json.dumps({"framework": plan.framework, "names": plan.names, "test_files": plan.test_files})
        timeout = min(task.test_timeout_s, self.grade_timeout_s or task.test_timeout_s)
        result = fresh.run(runner_command(), timeout_s=timeout, stdin=f"{nonce}\n{config}\n".encode())
        if result.timed_out:
            return GradeResult(0.0, f"the hidden tests timed out after {timeout:g} s")
        report = parse_report(result.output, nonce)
        if isinstance(report, str):  # what the run printed last, without any report line
            printed = "\n".join(line for line in result.output.splitlines() if not line.startswith(nonce))
            return GradeResult(0.0, f"{report} (exit {result.exit_code}): {printed.strip()[-300:]}")
        return verdict(report, plan.required)

    def score(self, prompt: Prompt, state: dict[str, Any], replies: list[list[int]]) -> EpisodeOutcome:
        ep: EpisodeState = state["episode"]
        self._close(ep)  # also when the driver stopped the episode (max_turns, a full context)
        last = self.tokenizer.decode(replies[-1], skip_special_tokens=True) if replies else ""
        return EpisodeOutcome(
            reward=ep.reward,
            num_turns=len(replies),
            empty_final_reply=not last.strip(),
            no_tool_call_termination=ep.no_tool_end,
            format_errors=ep.format_errors,
            tool_calls=ep.tool_calls,
            success=ep.reward == 1.0,
            details={
                "instance_id": ep.task.instance_id,
                "reason": ep.reason,
                "empty_replies": ep.empty_replies,
                "sandbox_seconds": round(ep.sandbox_seconds, 3),
                "touched_test_infra": ep.touched_test_infra or [],
            },
            touched_test_infra=None if ep.touched_test_infra is None else bool(ep.touched_test_infra),
        )
