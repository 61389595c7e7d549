"""`rlfleet env try`: run an environment's episodes with a scripted policy instead of a model.

The policy is a JSONL of replies per task (`{"instance_id": ..., "replies": ["<text>", ...]}`); a
sampler stand-in answers each turn with the task's next reply (encoded by the tokenizer and closed
with the chat template's end-of-turn id; an empty reply once they run out), and the episodes run
through the rollout driver's own episode loop (`RolloutDriver.run_episode`) and the environment,
as in training. One JSON line per episode: task, reward, turns, reason and the episode's metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from rlfleet.records import SampledTurn
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.trainer.envs.environments import ChatTurnEncoder
from rlfleet.trainer.envs.prompts import Prompt
from rlfleet.trainer.envs.swe_bench import is_swe_bench_file, load_swe_bench
from rlfleet.trainer.envs.swe_env import SweEnv, load_tasks, require_local_snapshot
from rlfleet.trainer.rollout.driver import RolloutDriver

ENVIRONMENTS = ("swe",)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_chat_tokenizer() -> Any:
    """A byte-level tokenizer (every byte one id, no merges) with a ChatML template: any text round-
    trips, so a scripted policy's replies reach the environment exactly as written."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    return hf


def load_policy(path: Path) -> dict[str, list[str]]:
    policy: dict[str, list[str]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from None
        # a JSON line that is not an object ([1, 2], 3, "text") is refused here, never indexed
        if not (
            isinstance(row, dict)
            and isinstance(row.get("instance_id"), str)
            and isinstance(row.get("replies"), list)
        ):
            raise ValueError(
                f"{path}:{lineno}: a policy line is {{'instance_id': str, 'replies': [str, ...]}}"
            )
        policy[row["instance_id"]] = [str(r) for r in row["replies"]]
    return policy


class ScriptedSampler:
    """The generate function of the rollout driver, replaying each episode's scripted replies."""

    def __init__(self, tokenizer: Any, replies_by_prompt: dict[int, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn_id = ChatTurnEncoder(tokenizer).end_of_turn_id
        self.replies = replies_by_prompt
        self.turn: dict[str, int] = {}

    async def __call__(self, session: str, ids: list[int], sampling: SamplingConfig) -> SampledTurn:
        prompt_index = int(session.split("/")[0].lstrip("p"))
        k = self.turn.get(session, 0)
        self.turn[session] = k + 1
        replies = self.replies.get(prompt_index, [])
        text = replies[k] if k < len(replies) else ""
        out = [*self.tokenizer.encode(text, add_special_tokens=False), self.end_of_turn_id]
        n = len(out)
        return SampledTurn(
            prompt_ids=np.asarray(ids, dtype=np.int32),
            output_ids=np.asarray(out, dtype=np.int32),
            logprobs=np.zeros(n, np.float32),
            sampled_logprobs=np.zeros(n, np.float32),
            support_offsets=np.arange(n + 1, dtype=np.int32),
            support_ids=np.asarray(out, dtype=np.int32),
            support_logprobs=np.zeros(n, np.float32),
            weight_versions=np.zeros(n, np.int64),
            finish_reason="stop",
            group="scripted",
            replica="scripted",
        )


def try_episodes(env: SweEnv, prompts: list[Prompt], sampler: ScriptedSampler) -> list[dict[str, Any]]:
    driver = RolloutDriver(
        sampler,
        env,
        prompts=None,  # type: ignore[arg-type]  # run_episode never reads the prompt source
        samples_per_prompt=1,
        sampling=SamplingConfig(max_new_tokens=1 << 16),
        max_seq_len=1 << 24,
    )
    lines = []
    for prompt in prompts:
        rollout = asyncio.run(driver.run_episode(prompt, 0))
        outcome = rollout.scored
        lines.append(
            {
                "task": outcome.details["instance_id"],
                "reward": outcome.reward,
                "turns": outcome.num_turns,
                "reason": outcome.details["reason"],
                "tool_calls": outcome.tool_calls,
                "format_errors": outcome.format_errors,
                "empty_replies": outcome.details["empty_replies"],
                "no_tool_call_end": outcome.no_tool_call_termination,
                "sandbox_seconds": outcome.details["sandbox_seconds"],
                "touched_test_infra": outcome.details["touched_test_infra"],
            }
        )
    return lines


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet env try", description=__doc__.splitlines()[0])
    parser.add_argument("--environment", required=True, choices=ENVIRONMENTS)
    parser.add_argument(
        "--tasks",
        required=True,
        type=Path,
        help="JSONL of tasks (examples/swe/tasks.jsonl), or of SWE-bench-style instances (detected by their "
        "fields problem_statement, base_commit, FAIL_TO_PASS: trainer/envs/swe_bench.py)",
    )
    parser.add_argument("--policy", required=True, type=Path, help="JSONL of scripted replies per task")
    parser.add_argument(
        "--tokenizer", help="a model's tokenizer directory (default: a byte-level ChatML one)"
    )
    parser.add_argument("--max-turns", type=int, default=50)
    parser.add_argument(
        "--grade-timeout", type=float, default=None, help="cap on the hidden tests' timeout (s)"
    )
    args = parser.parse_args(argv)
    from rlfleet.sandbox import SandboxUnavailable

    try:
        tasks = load_swe_bench(args.tasks) if is_swe_bench_file(args.tasks) else load_tasks(args.tasks)
        for task in tasks:  # before any episode runs: this command's sandbox is the local one
            require_local_snapshot(task)
        policy = load_policy(args.policy)
        unknown = sorted(set(policy) - {t.instance_id for t in tasks})
        if unknown:
            raise ValueError(f"{args.policy}: replies for tasks not in {args.tasks}: {unknown}")
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        else:
            tokenizer = byte_chat_tokenizer()
        env = SweEnv(tokenizer, max_turns=args.max_turns, grade_timeout_s=args.grade_timeout)
        prompts = [env.prompt(task, index=i) for i, task in enumerate(tasks)]
        sampler = ScriptedSampler(tokenizer, {i: policy.get(t.instance_id, []) for i, t in enumerate(tasks)})
        for line in try_episodes(env, prompts, sampler):
            print(json.dumps(line), flush=True)
    except (ValueError, OSError, SandboxUnavailable) as exc:
        print(f"rlfleet env try: {exc}", file=sys.stderr)
        return 2
    return 0
