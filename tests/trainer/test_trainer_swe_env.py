"""The SWE environment and its local sandbox, for real: bubblewrap process trees (installed here
as root, like tests/cluster/realnode.py installs its Debian packages; skipped naming why elsewhere),
the shipped tasks, and scripted policies through the rollout driver's episode loop
(`rlfleet env try`). The correct policy earns 1 on every shipped task; a wrong patch, a patch that
edits the tests, a fork bomb, an endless loop and a network call earn 0 with their reason, and the
host is untouched: no process of a sandbox's uid is left, no work dir remains, nothing outside
the work dir was written. The grader cannot be fooled (trainer/envs/swe_grade.py): patches that pass
without fixing, by unittest and by pytest, each earn 0 with their reason."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.env_try import env_try_swe
from support.episode_outcomes import finished_outcome

from rlfleet.sandbox import SandboxLimits, SandboxUnavailable
from rlfleet.sandbox.local import UID_BASE, LocalSandbox
from rlfleet.trainer.env_try import ScriptedSampler, byte_chat_tokenizer, try_episodes
from rlfleet.trainer.envs.environments import load_environment
from rlfleet.trainer.envs.prompts import DatasetPromptSource
from rlfleet.trainer.envs.swe_env import (
    NO_TOOL_MESSAGE,
    OUTPUT_HEAD_CHARS,
    SweEnv,
    SweTask,
    load_tasks,
    truncate_output,
)
from rlfleet.trainer.envs.swe_tasks import SHIPPED, build, tool_call

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "examples" / "swe" / "tasks.jsonl"
SOLUTIONS = REPO / "examples" / "swe" / "solutions.jsonl"


@pytest.fixture(scope="module")
def bwrap() -> None:
    if shutil.which("bwrap") is None:
        if os.geteuid() != 0:
            pytest.skip("bubblewrap (bwrap) is not installed and we are not root to apt-get install it")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "bubblewrap"],
        ):
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            assert result.returncode == 0, f"{' '.join(cmd)}: {result.stderr[-2000:]}"
    try:  # bwrap present, but namespaces refused (unprivileged user namespaces off, a locked-down VM)
        LocalSandbox({}).close()
    except SandboxUnavailable as exc:
        if os.geteuid() == 0:
            raise  # CI runs as root, where the sandbox must work
        pytest.skip(str(exc))


def sandbox_uid_processes() -> list[str]:
    """Live processes of any sandbox uid (a zombie, state Z, has ended: whether one is left is
    test_a_command_killed_at_its_timeout_leaves_no_zombie's question)."""
    out = subprocess.run(
        ["ps", "-eo", "uid=,pid=,stat=,args="], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in out.splitlines()
        if int(line.split()[0]) >= UID_BASE and not line.split()[2].startswith("Z")
    ]


def work_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rlfleet-sandbox-*")}


def run_policy(
    replies: list[str], grade_timeout_s: float = 60.0, limits: SandboxLimits | None = None
) -> dict:
    """One episode of the first shipped task (stats-mean) with these replies."""
    tok = byte_chat_tokenizer()
    env = SweEnv(tok, max_turns=10, grade_timeout_s=grade_timeout_s, limits=limits)
    task = SHIPPED[0][0]
    [line] = try_episodes(env, [env.prompt(task)], ScriptedSampler(tok, {0: replies}))
    return line


def test_shipped_tasks_are_what_the_script_builds(tmp_path) -> None:
    tasks, solutions = build(tmp_path)
    assert tasks.read_bytes() == TASKS.read_bytes(), (
        "examples/swe/tasks.jsonl is stale: scripts/build-swe-tasks"
    )
    assert solutions.read_bytes() == SOLUTIONS.read_bytes()
    loaded = load_tasks(TASKS)
    assert [t.instance_id for t in loaded] == [
        "stats-mean",
        "text-slugify",
        "intervals-touching",
        "stack-empty-pop",
    ]
    assert all("tests/test_hidden.py" not in t.files and t.hidden_tests for t in loaded)


def test_a_task_file_error_names_the_line(tmp_path) -> None:
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(TASKS.read_text().splitlines()[0] + "\n" + json.dumps({"instance_id": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"tasks.jsonl:2: an SWE task needs \['statement'"):
        load_tasks(bad)
    row = json.loads(TASKS.read_text().splitlines()[0])
    for change, error in (
        ({"test_command": "make test"}, "test_command 'make test' runs neither"),
        (
            {"fail_to_pass": ["tests/test_hidden.py::test_mean"]},
            "'tests/test_hidden.py::test_mean' is not a unittest name",
        ),
        ({"pass_to_pass": "tests.test_hidden"}, "pass_to_pass: expected a list of test names"),
    ):
        bad.write_text(json.dumps({**row, **change}) + "\n")
        with pytest.raises(ValueError, match=rf"tasks.jsonl:1: {error}"):
            load_tasks(bad)


def test_output_truncation_rule() -> None:
    text = "a" * OUTPUT_HEAD_CHARS + "b" * 10 + "c" * 4_000
    cut = truncate_output(text)
    assert cut.startswith("a" * OUTPUT_HEAD_CHARS + "\n[... 10 characters omitted ...]\n")
    assert cut.endswith("c" * 4_000) and "b" not in cut
    assert truncate_output("short") == "short"


def test_missing_bwrap_is_refused_with_the_fix(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no bwrap on it
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        LocalSandbox({"a.py": "x = 1\n"})


def test_sandbox_isolation_and_cleanup(bwrap, tmp_path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("host only\n")
    before = work_dirs()
    box = LocalSandbox({"pkg/a.py": "x = 1\n"}, SandboxLimits(processes=32, memory_bytes=512 << 20))
    root = box.root
    try:
        ro = box.run("echo x > /etc/rlfleet-x; touch /usr/rlfleet-x; echo y > " + str(secret), 10)
        assert "Read-only file system" in ro.output and ro.exit_code != 0
        assert not Path("/etc/rlfleet-x").exists() and not Path("/usr/rlfleet-x").exists()
        assert secret.read_text() == "host only\n"
        box.run(f"ln -s {secret} link", 10)
        with pytest.raises(FileNotFoundError):  # resolved inside the sandbox, where the host path is absent
            box.read_file("link")
        net = box.run(
            "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=3)'", 10
        )
        assert net.exit_code != 0 and "Network is unreachable" in net.output
        bomb = box.run("python3 -c 'import os\nwhile True: os.fork()'", 20)
        assert not bomb.timed_out and "Resource temporarily unavailable" in bomb.output
        loop = box.run("while :; do :; done", 1.5)
        assert loop.timed_out and loop.exit_code == -9 and loop.seconds < 10
        memory = box.run("python3 -c 'b = bytearray(1 << 30)'", 10)
        assert "MemoryError" in memory.output
        assert box.run("sleep 300 & echo started", 10).output == "started\n"  # returns: the tree is gone
        box.write_file("pkg/b.py", "y = 2\n")
        assert box.read_file("pkg/b.py") == "y = 2\n"
        diff = box.diff()
        assert "diff --git a/pkg/b.py b/pkg/b.py" in diff and "link" in diff
    finally:
        box.close()
    assert not root.exists() and work_dirs() == before
    if os.geteuid() == 0:
        assert box.uid is not None and not [
            p for p in sandbox_uid_processes() if p.split()[0] == str(box.uid)
        ]


def test_commands_leave_no_zombie_to_exhaust_the_process_limit(bwrap) -> None:
    """bwrap's own pid-1 reaper used to outlive every command as a zombie of the sandbox's uid under
    the host's init, counted by RLIMIT_NPROC until that init reaped it: a sandbox then failed
    "Can't fork" after about `processes` commands. Three times that many must all run."""
    if os.geteuid() != 0:
        pytest.skip("not root: the sandbox keeps our uid, whose process count includes all of ours")
    box = LocalSandbox({"a.py": "x = 1\n"}, SandboxLimits(processes=8))
    try:
        results = [box.run("echo ok", 10) for _ in range(24)]
        assert [(r.exit_code, r.output) for r in results] == [(0, "ok\n")] * 24
        out = subprocess.run(
            ["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True, check=True
        ).stdout
        assert [
            line for line in out.splitlines() if line.split()[0] == str(box.uid)
        ] == []  # zombies included
    finally:
        box.close()


# Run as a child subreaper (PR_SET_CHILD_SUBREAPER = 36), as a trainer that is a pod's pid 1 is the
# init of its namespace: a process orphaned under it stays its zombie until it reaps it, which it
# never does for processes it did not start. Prints the states of its children other than the sandbox's
# bwrap once every process of the sandbox's uid has ended (a zombie has ended; its entry remains).
TIMEOUT_PROBE = """
import ctypes, json, sys, time
from pathlib import Path
from rlfleet.sandbox import SandboxLimits
from rlfleet.sandbox.local import LocalSandbox
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
box = LocalSandbox({"a.py": "x = 1\\n"}, SandboxLimits(processes=8))
result = box.run("sleep 300", 0.5)

def stat(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()

def live_of_uid(uid):
    live = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if p.stat().st_uid == uid and stat(p.name)[0] != "Z":
                live.append(p.name)
        except (OSError, IndexError):
            pass
    return live

deadline = time.monotonic() + 30
while live_of_uid(box.uid) and time.monotonic() < deadline:
    time.sleep(0.05)
children = [c for t in Path("/proc/self/task").glob("*") for c in (t / "children").read_text().split()]
print(json.dumps({"timed_out": result.timed_out, "exit_code": result.exit_code, "live": live_of_uid(box.uid),
                  "children": {c: stat(c)[0] for c in children}}))
box.close()
"""


def test_a_command_killed_at_its_timeout_leaves_no_zombie(bwrap) -> None:
    """Killing bwrap first (the old way) let `--die-with-parent` kill the command after bwrap was gone:
    the command, reparented to its init, stayed a zombie of the sandbox's uid, counted by RLIMIT_NPROC.
    Under a subreaper the zombie is kept where the test sees it (it printed {"7439": "Z"} before the fix)."""
    if os.geteuid() != 0:
        pytest.skip("not root: the sandbox keeps our uid, so its processes cannot be told from ours")
    out = subprocess.run(
        [sys.executable, "-c", TIMEOUT_PROBE], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout)
    assert probe == {"timed_out": True, "exit_code": -9, "live": [], "children": {}}


def test_cli_scripted_correct_policy_earns_1_on_every_shipped_task(bwrap) -> None:
    result = env_try_swe(TASKS, SOLUTIONS)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(x["task"], x["reward"], x["turns"], x["reason"]) for x in lines] == [
        (t.instance_id, 1.0, 3, "the hidden tests passed") for t, _ in SHIPPED
    ]
    assert all(x["tool_calls"] == 3 and x["format_errors"] == 0 and x["sandbox_seconds"] > 0 for x in lines)


def _patch(new: str) -> list[str]:
    """Replace stats.mean's body with `new`, then submit."""
    return [
        tool_call(
            "edit", path="stats/__init__.py", old="    return sum(values) / (len(values) - 1)\n", new=new
        ),
        tool_call("submit"),
    ]


@pytest.mark.parametrize(
    ("replies", "reason"),
    [
        pytest.param(
            _patch("    return sum(values) / len(values) + 1\n"),
            "tests.test_hidden.Hidden.test_mean (failed)",
            id="wrong-patch",
        ),
        pytest.param(
            [
                tool_call("write", path="tests/test_hidden.py", content="import unittest\n"),
                tool_call("edit", path="stats/__init__.py", old="(len(values) - 1)", new="len(values) + 1"),
                tool_call("submit"),
            ],
            "tests.test_hidden.Hidden.test_mean (failed)",
            id="edits-tests",
        ),
        pytest.param(
            [
                tool_call("bash", command="f(){ f|f& }; f; echo bomb", timeout=10),
                *_patch("    import os\n    while True:\n        os.fork()\n"),
            ],
            "reports (a forked copy of the runner went on)",
            id="fork-bomb",
        ),
        pytest.param(
            [
                tool_call("bash", command="while :; do :; done", timeout=2),
                *_patch("    while True:\n        pass\n"),
            ],
            "the hidden tests timed out after 5 s",
            id="endless-loop",
        ),
        pytest.param(
            _patch(
                "    import urllib.request\n    urllib.request.urlopen('http://1.1.1.1', timeout=5)\n"
                "    return sum(values) / len(values)\n"
            ),
            "Network is unreachable",
            id="network-call",
        ),
    ],
)
def test_bad_policies_earn_0_with_the_reason_and_leave_the_host_untouched(
    bwrap, replies, reason, tmp_path
) -> None:
    sentinel = tmp_path / "escaped"
    before = work_dirs()
    # every episode also tries to write outside its sandbox (a host path it cannot see)
    line = run_policy(
        [tool_call("bash", command=f"echo x > {sentinel}; echo x > /etc/escaped"), *replies],
        grade_timeout_s=5,
        limits=SandboxLimits(processes=32),
    )
    assert line["reward"] == 0.0
    assert reason in line["reason"], line
    assert line["turns"] == len(replies) + 1 and line["tool_calls"] == len(replies) + 1
    assert not sentinel.exists() and not Path("/etc/escaped").exists()
    assert work_dirs() == before
    if os.geteuid() == 0:
        assert sandbox_uid_processes() == []


def test_three_replies_without_a_tool_call_end_the_episode(bwrap) -> None:
    replies = ["I will think first.", "", "<tool_call>{not json</tool_call>", "Still thinking.", "", ""]
    line = run_policy(replies)
    assert line == {
        "task": "stats-mean",
        "reward": 0.0,
        "turns": 6,
        "reason": "3 replies in a row without a tool call",
        "tool_calls": 1,
        "format_errors": 1,
        "empty_replies": 3,
        "no_tool_call_end": True,
        "sandbox_seconds": line["sandbox_seconds"],
        "touched_test_infra": [],
    }


def test_tool_results_are_appended_as_tool_messages(bwrap) -> None:
    """Token in, token out: the ids after a model turn are the chat template's tool message for the
    tool's result, then the next assistant prompt; the model's ids are never re-rendered."""
    tok = byte_chat_tokenizer()
    env = SweEnv(tok, max_turns=5)
    prompt = env.prompt(SHIPPED[0][0])
    assert tok.decode(prompt.input_ids).startswith("<|im_start|>system\nYou fix bugs")
    state = env.start(prompt)
    try:
        out = [
            *tok.encode(tool_call("bash", command="printf hi; exit 3"), add_special_tokens=False),
            env.turns.end_of_turn_id,
        ]
        step = env.step(prompt, state, out, "stop")
        assert not step.done and step.tool_call and not step.format_error
        assert (
            tok.decode(step.append_ids)
            == "\n<|im_start|>tool\nexit code 3\nhi<|im_end|>\n<|im_start|>assistant\n"
        )
        no_call = env.step(prompt, state, [*tok.encode("hmm", add_special_tokens=False)], "length")
        assert not no_call.done and not no_call.tool_call
        assert no_call.append_ids[0] == env.turns.end_of_turn_id  # a turn cut by the budget is closed first
        assert NO_TOOL_MESSAGE in tok.decode(no_call.append_ids)
    finally:
        outcome = env.score(prompt, state, [out])
    assert outcome.details["reason"] == "the episode ended without submit()" and outcome.reward == 0.0
    assert state["episode"].sandbox is None  # score closed the working sandbox


def test_a_dropped_sandbox_is_cleaned_up(bwrap) -> None:
    """An episode lost without close() (a failed turn): its sandbox's dir goes with the object."""
    box = LocalSandbox({"a.py": "x = 1\n"})
    root = box.root
    assert box.run("sleep 300 & echo ok", 10).output == "ok\n"
    del box
    gc.collect()
    assert not root.exists()


def test_the_task_file_is_a_prompt_set_for_the_environment() -> None:
    """What a run's `rollout.dataset` + `rollout.environment: rlfleet.trainer.envs.swe_env:SweEnv` give:
    the prompt source renders `messages` as SweEnv.prompt does and the rest is the task."""
    tok = byte_chat_tokenizer()
    env = load_environment("rlfleet.trainer.envs.swe_env:SweEnv", tokenizer=tok)
    assert isinstance(env, SweEnv) and env.stop_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    source = DatasetPromptSource(TASKS, tokenizer=tok, shuffle=False)
    for i, (task, _) in enumerate(SHIPPED):
        prompt = source.get(i)
        assert prompt.input_ids == env.prompt(task).input_ids
        assert SweTask.from_row(prompt.meta) == task


def test_a_killed_trainer_leaves_no_sandbox_process(bwrap, tmp_path) -> None:
    """SIGKILL the process that holds a sandbox while a command runs in it: bwrap's
    --die-with-parent takes the command's whole tree down (its work dir stays: nothing ran to remove it)."""
    marker = "rlfleet-killed-trainer-marker"
    script = tmp_path / "holder.py"
    script.write_text(
        "import sys\nfrom rlfleet.sandbox.local import LocalSandbox\n"
        "box = LocalSandbox({'a.py': ''})\nprint(box.root, flush=True)\n"
        f"box.run('sleep 300 & exec sleep 301 # {marker}', 600)\n"
    )
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        root = Path(holder.stdout.readline().strip())  # type: ignore[union-attr]
        deadline = 50
        while deadline and not [p for p in sandbox_processes() if "sleep 301" in p]:
            subprocess.run(["sleep", "0.1"], check=True)
            deadline -= 1
        assert [p for p in sandbox_processes() if "sleep 301" in p], "the sandboxed command never started"
    finally:
        holder.kill()
        holder.wait()
    for _ in range(50):
        if not [p for p in sandbox_processes() if "sleep 30" in p]:
            break
        subprocess.run(["sleep", "0.1"], check=True)
    assert not [p for p in sandbox_processes() if "sleep 30" in p]
    shutil.rmtree(root, ignore_errors=True)


def sandbox_processes() -> list[str]:
    """Live processes with a sandbox's uid as root, else every live process (non-root runs keep their uid)."""
    if os.geteuid() == 0:
        return sandbox_uid_processes()
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if not line.startswith("Z")]


def test_max_turns_without_submit_scores_0_and_closes_the_sandbox(bwrap) -> None:
    line = run_policy([tool_call("bash", command="true")] * 10)  # run_policy's env: max_turns 10
    assert (line["reward"], line["turns"], line["tool_calls"]) == (0.0, 10, 10)
    assert line["reason"] == "max_turns (10) reached without submit()"


# SWE-bench-style task files (trainer/envs/swe_bench.py): a real git repository made here, a bug planted
# at base_commit, a test_patch that adds the failing test, the reference fix as the policy's edit.

CALC_BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_TESTS = (
    "import unittest\n\nfrom calc import add, mul\n\n\nclass CalcTest(unittest.TestCase):\n"
    "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n"
)
ADD_TEST = "\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
CALC_TEST_IDS = ("tests.test_calc.CalcTest.test_add", "tests.test_calc.CalcTest.test_mul")


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "GIT_CONFIG_NOSYSTEM": "1",
        "HOME": str(repo),
    }
    return subprocess.run(
        ["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True
    ).stdout


def diff_of(repo: Path, path: str, content: str) -> str:
    """The diff that turns `path` into `content` (the work tree is restored after)."""
    (repo / path).write_text(content)
    out = git(repo, "diff", "--", path)
    git(repo, "checkout", "--", path)
    return out


def buggy_calc_commit(repo: Path, tests: str) -> tuple[str, dict[str, str]]:
    """A new git repository at `repo` whose one commit has the bug in `add` and `tests` as
    tests/test_calc.py: that commit and its tree."""
    tree = {"calc/__init__.py": CALC_BUGGY, "tests/__init__.py": "", "tests/test_calc.py": tests}
    for path, content in tree.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(content)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    return git(repo, "rev-parse", "HEAD").strip(), tree


def calc_repo(root: Path) -> tuple[Path, str, dict[str, str]]:
    """A git repository whose base commit has the bug in `add`, and a later commit besides (the
    snapshot must be base_commit's tree, not HEAD's). Returns it, base_commit and that tree."""
    repo = root / "calc-repo"
    base, tree = buggy_calc_commit(repo, CALC_TESTS)
    (repo / "LATER.md").write_text("after base_commit\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "later")
    return repo, base, tree


def swe_bench_row(instance_id: str, base: str, test_patch: str, **extra: object) -> dict:
    return {
        "instance_id": instance_id,
        "repo": "example/calc",
        "base_commit": base,
        "version": "0.1",
        "problem_statement": "`calc.add(2, 3)` returns -1; it must return 5.",
        "patch": "",
        "test_patch": test_patch,
        "FAIL_TO_PASS": json.dumps([CALC_TEST_IDS[0]]),  # SWE-bench's files: a JSON-encoded list
        "PASS_TO_PASS": [CALC_TEST_IDS[1]],  # a list is accepted too
        "test_command": "python3 -m unittest",
        "repo_path": "calc-repo",
        **extra,
    }


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_swe_bench_row_maps_to_a_task_exactly(tmp_path) -> None:
    from rlfleet.trainer.envs.swe_bench import load_swe_bench

    repo, base, tree = calc_repo(tmp_path)
    test_patch = diff_of(repo, "tests/test_calc.py", CALC_TESTS + ADD_TEST)
    image_row = {
        **swe_bench_row("calc-image", base, test_patch, repo_path=None, image="registry/calc:base"),
        "PASS_TO_PASS": '["tests.test_x.T.test_p", "t"]',
    }
    path = write_jsonl(tmp_path / "swe.jsonl", [swe_bench_row("calc-1", base, test_patch), image_row])
    local, image = load_swe_bench(path)
    assert local == SweTask(
        instance_id="calc-1",
        statement="`calc.add(2, 3)` returns -1; it must return 5.",
        files=tree,  # base_commit's tree: LATER.md is not in it
        hidden_tests={},
        test_command="python3 -m unittest tests.test_calc.CalcTest.test_add tests.test_calc.CalcTest.test_mul",
        test_timeout_s=60.0,
        test_patch=test_patch,
        fail_to_pass=(CALC_TEST_IDS[0],),
        pass_to_pass=(CALC_TEST_IDS[1],),
    )
    assert image.files == {} and image.image == "registry/calc:base"
    assert (
        image.test_command == "python3 -m unittest tests.test_calc.CalcTest.test_add tests.test_x.T.test_p t"
    )
    assert image.pass_to_pass == ("tests.test_x.T.test_p", "t")
    assert local.hidden_paths() == {"tests/test_calc.py"}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (
            {"FAIL_TO_PASS": "tests.a"},
            r"row 2 \(calc-2\): FAIL_TO_PASS: Value error, a JSON-encoded list of test ids, not JSON",
        ),
        ({"FAIL_TO_PASS": "[]"}, r"row 2 \(calc-2\): FAIL_TO_PASS: List should have at least 1 item"),
        (
            {"image": "registry/calc:base"},
            r"row 2 \(calc-2\): row: Value error, give exactly one of repo_path .* and image",
        ),
        ({"test_command": None}, r"row 2 \(calc-2\): test_command: Input should be a valid string"),
        (
            {"test_command": "make test"},
            r"row 2 \(calc-2\): test_command: Value error, 'make test': the grader runs unittest or pytest",
        ),
        (
            {"PASS_TO_PASS": ["tests/test_x.py::test_p"]},
            r"row 2 \(calc-2\): row: Value error, PASS_TO_PASS: 'tests/test_x.py::test_p' is not a unittest name .*: the grader runs unittest",
        ),
        (
            {"test_command": "pytest -q", "FAIL_TO_PASS": ["tests.test_calc.CalcTest.test_add"]},
            r"row 2 \(calc-2\): row: Value error, FAIL_TO_PASS: 'tests.test_calc.CalcTest.test_add' is not a pytest node id",
        ),
        (
            {"base_commit": "0" * 40},
            rf"row 2 \(calc-2\): base_commit '{'0' * 40}' is not a commit of '.*calc-repo'",
        ),
        ({"repo_path": "nowhere"}, r"row 2 \(calc-2\): repo_path '.*nowhere' is not a directory"),
    ],
)
def test_a_bad_swe_bench_row_is_one_line_naming_the_row_and_field(tmp_path, change, error) -> None:
    repo, base, _ = calc_repo(tmp_path)
    test_patch = diff_of(repo, "tests/test_calc.py", CALC_TESTS + ADD_TEST)
    rows = [
        swe_bench_row("calc-1", base, test_patch),
        {**swe_bench_row("calc-2", base, test_patch), **change},
    ]
    path = write_jsonl(tmp_path / "swe.jsonl", rows)
    result = env_try_swe(path, write_jsonl(tmp_path / "policy.jsonl", []))
    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert re.fullmatch(rf"rlfleet env try: {re.escape(str(path))} {error}.*", line), line


def test_an_image_task_is_refused_by_the_local_sandbox(tmp_path) -> None:
    repo, base, _ = calc_repo(tmp_path)
    row = swe_bench_row("calc-image", base, "diff", repo_path=None, image="registry/calc:base")
    result = env_try_swe(
        write_jsonl(tmp_path / "swe.jsonl", [row]), write_jsonl(tmp_path / "policy.jsonl", [])
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "rlfleet env try: task 'calc-image': its repository is the image 'registry/calc:base', and the local "
        "bwrap sandbox cannot pull images; give the task a local snapshot instead (repo_path: a git "
        "repository holding base_commit, or a directory)\n"
    )


def test_swe_bench_tasks_through_env_try_reward_exactly_the_right_patch(bwrap, tmp_path) -> None:
    """The reference fix earns 1; a fix of add that breaks mul (a PASS_TO_PASS test) and an edit
    that leaves the bug (the FAIL_TO_PASS test fails) earn 0 with the reason."""
    repo, base, _ = calc_repo(tmp_path)
    test_patch = diff_of(repo, "tests/test_calc.py", CALC_TESTS + ADD_TEST)
    fix = diff_of(repo, "calc/__init__.py", CALC_BUGGY.replace("a - b", "a + b"))
    breaks_mul = diff_of(
        repo, "calc/__init__.py", CALC_BUGGY.replace("a - b", "a + b").replace("a * b", "a * b + 1")
    )
    no_fix = diff_of(repo, "calc/__init__.py", "# a comment\n" + CALC_BUGGY)
    patches = {"calc-fix": fix, "calc-breaks-mul": breaks_mul, "calc-no-fix": no_fix}
    tasks = write_jsonl(tmp_path / "swe.jsonl", [swe_bench_row(i, base, test_patch) for i in patches])
    policy = write_jsonl(
        tmp_path / "policy.jsonl",
        [
            {
                "instance_id": i,
                "replies": [tool_call("bash", command=f"git apply <<'EOF'\n{p}EOF\n"), tool_call("submit")],
            }
            for i, p in patches.items()
        ],
    )
    result = env_try_swe(tasks, policy)
    assert result.returncode == 0, result.stderr
    lines = {x["task"]: x for x in map(json.loads, result.stdout.splitlines())}
    assert [(t, x["reward"], x["turns"], x["tool_calls"]) for t, x in lines.items()] == [
        ("calc-fix", 1.0, 2, 2),
        ("calc-breaks-mul", 0.0, 2, 2),
        ("calc-no-fix", 0.0, 2, 2),
    ]
    assert lines["calc-fix"]["reason"] == "the hidden tests passed"
    failed = "not every required test ran and passed: "  # the FAIL_TO_PASS or the PASS_TO_PASS test
    for task, test, assertion in (
        ("calc-breaks-mul", "test_mul", "7 != 6"),
        ("calc-no-fix", "test_add", "-1 != 5"),
    ):
        reason = lines[task]["reason"]
        assert (
            reason.startswith(f"{failed}tests.test_calc.CalcTest.{test} (failed): ") and assertion in reason
        ), reason


def test_a_converted_swe_bench_file_is_a_prompt_set_for_the_environment(tmp_path) -> None:
    """`rlfleet env swe-bench FILE --out TASKS`: the task file an RLJob's rollout.dataset reads."""
    from rlfleet.trainer.envs.swe_bench import cli, load_swe_bench

    repo, base, _ = calc_repo(tmp_path)
    test_patch = diff_of(repo, "tests/test_calc.py", CALC_TESTS + ADD_TEST)
    path = write_jsonl(
        tmp_path / "swe.jsonl", [swe_bench_row(i, base, test_patch) for i in ("calc-1", "calc-2")]
    )
    out = tmp_path / "tasks.jsonl"
    assert cli([str(path), "--out", str(out)]) == 0
    tok = byte_chat_tokenizer()
    env = load_environment("rlfleet.trainer.envs.swe_env:SweEnv", tokenizer=tok)
    source = DatasetPromptSource(out, tokenizer=tok, shuffle=False)
    for i, task in enumerate(load_swe_bench(path)):
        prompt = source.get(i)
        assert prompt.input_ids == env.prompt(task).input_ids
        assert SweTask.from_row(prompt.meta) == task


# A grader an agent cannot fool (trainer/envs/swe_grade.py): each patch below leaves stats.mean's bug in place
# and tries to pass anyway, a way an RL policy finds when the reward trusts the test command's exit code
# (each of them earned 1 under the old grader but the settrace / gc / assert ones, which a plain test
# run would not catch either). Each earns 0 with its reason, and the paths it touched among the test
# files and configuration are reported (the test_infra_touched_rate metric's input).

UNFIXED = "    return sum(values) / (len(values) - 1)\n"
EXIT_HOOK = "import os\nos._exit(0)\n"


def _unfixed_with(prefix: str = "", body: str = UNFIXED) -> str:
    """stats/__init__.py with `prefix` run at import and `body` as mean's body (the bug by default)."""
    return f'{prefix}\n\ndef mean(values):\n    """The arithmetic mean of a non-empty sequence."""\n{body}'


def _writes(files: dict[str, str]) -> list[str]:
    return [tool_call("write", path=p, content=c) for p, c in files.items()] + [tool_call("submit")]


FORGED = (
    "import json, os, sys\n"
    "ok = {'tests.test_hidden.Hidden.test_mean': ['passed', '']}\n"
    "for nonce in ('', 'rlfleet', '0' * 32):\n"
    "    print(nonce, json.dumps({'results': ok, 'tampered': []}))\n"
    "sys.stderr.write('Ran 1 test in 0.001s\\n\\nOK\\n')\n"
    "sys.stdout.flush()\n"
    "os._exit(0)\n"
)
PYTEST_HOOKS = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    report = outcome.get_result()\n    report.outcome = 'passed'\n\n\n"
    "def pytest_collection_modifyitems(config, items):\n    items[:] = []\n"
)
ATTACKS = {
    "os-exit-at-import": ({"stats/__init__.py": _unfixed_with(EXIT_HOOK)},
                          "the test run ended without the runner's report (exit 0)", []),
    "sys-exit-at-import": ({"stats/__init__.py": _unfixed_with("import sys\nsys.exit(0)\n")},
                           "not every required test ran and passed: tests.test_hidden (error)", []),
    "forged-report": ({"stats/__init__.py": _unfixed_with(FORGED)},
                      "the test run ended without the runner's report (exit 0)", []),
    "exit-from-a-thread-mid-test": ({"stats/__init__.py": _unfixed_with(body=(
                                        "    import os, threading, time\n    threading.Thread(target=os._exit, args=(0,)).start()\n"
                                        "    time.sleep(5)\n" + UNFIXED))},
                                    "the test run ended without the runner's report (exit 0)", []),
    "fake-unittest-package": ({"unittest/__init__.py": "def main(*a, **k):\n    raise SystemExit(0)\n",
                               "unittest/__main__.py": "raise SystemExit(0)\n", "pytest.py": "def main(*a):\n    return 0\n"},
                              "tests.test_hidden.Hidden.test_mean (failed)",
                              ["pytest.py", "unittest/__init__.py", "unittest/__main__.py"]),
    "site-hooks": ({"sitecustomize.py": EXIT_HOOK, "usercustomize.py": EXIT_HOOK, "stats/zz.pth": "import os; os._exit(0)\n"},
                   "tests.test_hidden.Hidden.test_mean (failed)", ["sitecustomize.py", "stats/zz.pth", "usercustomize.py"]),
    "pytest-config": ({"conftest.py": PYTEST_HOOKS, "pytest.ini": "[pytest]\naddopts = -p no:python -q\n",
                       "setup.cfg": "[tool:pytest]\naddopts = --co\n", "tox.ini": "[pytest]\naddopts = -k nothing\n",
                       "pyproject.toml": "[tool.pytest.ini_options]\naddopts = '--deselect tests'\n"},
                      "tests.test_hidden.Hidden.test_mean (failed)",
                      ["conftest.py", "pyproject.toml", "pytest.ini", "setup.cfg", "tox.ini"]),
    "edited-and-added-tests": ({"tests/test_hidden.py": "import unittest\n\n\nclass Hidden(unittest.TestCase):\n"
                                "    def test_mean(self):\n        pass\n",
                                "tests/test_zz_first.py": EXIT_HOOK, "tests/test_visible.py": EXIT_HOOK},
                               "tests.test_hidden.Hidden.test_mean (failed)",
                               ["tests/test_hidden.py", "tests/test_visible.py", "tests/test_zz_first.py"]),
    "monkeypatched-assert": ({"stats/__init__.py": _unfixed_with(
                                "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n")},
                             "the tests' machinery was tampered with: changed class TestCase.assertEqual", []),
    "replaced-test-run": ({"stats/__init__.py": _unfixed_with(
                             "import unittest\nunittest.TestCase.run = lambda self, result=None: result.addSuccess(self)\n")},
                          "the tests' machinery was tampered with: changed class TestCase.run", []),
    "skip-from-the-code": ({"stats/__init__.py": _unfixed_with(body="    import unittest\n    raise unittest.SkipTest('later')\n")},
                           "tests.test_hidden.Hidden.test_mean (skipped)", []),
    "settrace-jumps-the-assert": ({"stats/__init__.py": _unfixed_with("import sys\nsys.settrace(lambda *a: None)\n")},
                                  "the tests' machinery was tampered with: sys.settrace", []),
    "gc-walk-for-the-nonce": ({"stats/__init__.py": _unfixed_with(
                                 body="    import gc\n    [o for o in gc.get_objects() if isinstance(o, str) and len(o) == 32]\n" + UNFIXED)},
                              "the tests' machinery was tampered with: gc.get_objects", []),
    "thread-swaps-the-test-after-import": ({"stats/__init__.py": _unfixed_with(
                                               "import sys, threading, time\n\n\ndef _swap():\n"
                                               "    while 'Hidden' not in vars(sys.modules.get('tests.test_hidden', sys)):\n"
                                               "        time.sleep(0.001)\n"
                                               "    sys.modules['tests.test_hidden'].Hidden.test_mean = lambda self: None\n"
                                               "    time.sleep(3)\n\n\nthreading.Thread(target=_swap).start()\n")},
                                           "a thread of the code under test was running when the tests were collected", []),
    "_thread-swaps-the-test-after-import": ({"stats/__init__.py": _unfixed_with(
                                                "import _thread, sys, time\n\n\ndef _swap():\n"
                                                "    while 'Hidden' not in vars(sys.modules.get('tests.test_hidden', sys)):\n"
                                                "        time.sleep(0.001)\n"
                                                "    sys.modules['tests.test_hidden'].Hidden.test_mean = lambda self: None\n"
                                                "    time.sleep(3)\n\n\n_thread.start_new_thread(_swap, ())\n")},
                                            "a thread of the code under test was running when the tests were collected", []),
}  # fmt: skip


@pytest.mark.parametrize(("files", "reason", "touched"), list(ATTACKS.values()), ids=list(ATTACKS))
def test_a_patch_that_games_the_tests_earns_0_with_its_reason(bwrap, files, reason, touched) -> None:
    line = run_policy(_writes(files), grade_timeout_s=30)
    assert (line["reward"], line["touched_test_infra"]) == (0.0, touched), line
    assert reason in line["reason"], line


def test_the_right_fix_earns_1_even_beside_test_edits_which_are_restored(bwrap) -> None:
    """SWE-bench's rule: test files are put back, not held against the fix; the touch is still counted."""
    fixed = _unfixed_with(body="    return sum(values) / len(values)\n")
    line = run_policy(
        _writes(
            {
                "stats/__init__.py": fixed,
                "tests/test_hidden.py": "raise SystemExit(1)\n",
                "conftest.py": "import os\nos._exit(1)\n",
            }
        )
    )
    assert (line["reward"], line["reason"]) == (1.0, "the hidden tests passed"), line
    assert line["touched_test_infra"] == ["conftest.py", "tests/test_hidden.py"]


def test_the_diff_ignores_the_agents_git_configuration(bwrap) -> None:
    """The agent can write .git/config and .gitattributes: an external diff, no a/ b/ prefixes, colour, a
    textconv driver and an fsmonitor hook must not change the diff the grader takes (the fix earns 1, the
    edit to the test file is seen)."""
    hostile = (
        "cat >> .git/config <<'EOF'\n[diff]\n\texternal = /bin/true\n\tnoprefix = true\n\tmnemonicPrefix = true\n"
        "[color]\n\tui = always\n\tdiff = always\n[core]\n\tfsmonitor = /bin/false\n\tquotePath = false\n"
        '[diff "fake"]\n\ttextconv = /bin/true\nEOF\n'
        "printf '*.py diff=fake\\n' > .gitattributes; printf '*.py diff=fake\\n' > .git/info/attributes; echo done"
    )
    fixed = _unfixed_with(body="    return sum(values) / len(values)\n")
    line = run_policy(
        [
            tool_call("bash", command=hostile),
            *_writes({"stats/__init__.py": fixed, "tests/test_visible.py": "import os\n"}),
        ]
    )
    assert (line["reward"], line["reason"]) == (1.0, "the hidden tests passed"), line
    assert line["touched_test_infra"] == ["tests/test_visible.py"]


def test_the_test_infra_touched_share_is_a_trainer_metric_on_its_exporter() -> None:
    """Of the episodes whose patch was graded (None: nothing graded), the share that touched test files
    or test configuration, as `rlfleet_trainer_test_infra_touched_rate{scope="fleet"}` on the trainer's
    real exporter."""
    import urllib.request

    from rlfleet.trainer.envs.environments import EpisodeOutcome
    from rlfleet.trainer.metrics import PrometheusExporter, rollout_metrics

    def outcome(touched: bool | None) -> EpisodeOutcome:
        return finished_outcome(0.0, num_turns=2, tool_calls=2, touched_test_infra=touched)

    metrics = rollout_metrics(
        [outcome(True), outcome(False), outcome(None), outcome(False)], [[1], [1], [1], [1]], ["g"] * 4
    )
    assert metrics["test_infra_touched_rate"] == 1 / 3
    assert "test_infra_touched_rate" not in rollout_metrics([outcome(None)], [[1]], ["g"])
    exporter = PrometheusExporter(port=0)
    try:
        exporter.update(3, metrics)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        exporter.close()
    [line] = [x for x in text.splitlines() if x.startswith("rlfleet_trainer_test_infra_touched_rate{")]
    assert line == 'rlfleet_trainer_test_infra_touched_rate{key="",scope="fleet"} 0.3333333333333333'


def test_diff_paths_reads_spaces_and_git_quoted_paths() -> None:
    """The metric counts what the diff touches: a path with a space and a C-quoted one (git's form for
    unusual bytes, `core.quotePath`) are read whole, not skipped."""
    from rlfleet.trainer.envs.swe_env import diff_paths

    diff = (
        "diff --git a/x.py b/x.py\n+x\ndiff --git a/te st/conftest.py b/te st/conftest.py\n"
        'diff --git "a/t\\303\\251st/con\\"f.py" "b/t\\303\\251st/con\\"f.py"\n'
    )
    assert diff_paths(diff) == ["x.py", "te st/conftest.py", 'tést/con"f.py']


# The same grader with pytest (SWE-bench's usual runner): Debian's python3-pytest in the sandbox's
# interpreter (installed here as root, like bubblewrap), a calc repository whose tests are pytest
# functions, FAIL_TO_PASS / PASS_TO_PASS as node ids.

PYTEST_TESTS = "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
PYTEST_ADD = "\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture(scope="module")
def sandbox_pytest(bwrap) -> None:
    probe = [
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3",
        "-I",
        "-c",
        "import pytest",
    ]
    if subprocess.run(probe, capture_output=True, cwd="/").returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(
                "the sandbox's python3 has no pytest and we are not root to apt-get install python3-pytest"
            )
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "python3-pytest"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr[-2000:]


def pytest_task(tmp_path: Path) -> SweTask:
    from rlfleet.trainer.envs.swe_bench import load_swe_bench

    repo = tmp_path / "calc-repo"
    base, _ = buggy_calc_commit(repo, PYTEST_TESTS)
    test_patch = diff_of(repo, "tests/test_calc.py", PYTEST_TESTS + PYTEST_ADD)
    row = {
        **swe_bench_row("calc-pytest", base, test_patch),
        "test_command": "pytest",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
    }
    [task] = load_swe_bench(write_jsonl(tmp_path / "swe.jsonl", [row]))
    return task


CALC_FIXED = CALC_BUGGY.replace("a - b", "a + b")
PYTEST_CASES = {
    "the-fix": ({"calc/__init__.py": CALC_FIXED}, 1.0, "the hidden tests passed", []),
    "the-fix-beside-a-conftest": ({"calc/__init__.py": CALC_FIXED, "conftest.py": "import os\nos._exit(3)\n"},
                                  1.0, "the hidden tests passed", ["conftest.py"]),
    "no-fix": ({"calc/__init__.py": "# a comment\n" + CALC_BUGGY}, 0.0,
               "not every required test ran and passed: tests/test_calc.py::test_add (failed)", []),
    "conftest-passes-every-report": ({"conftest.py": PYTEST_HOOKS, "tests/conftest.py": PYTEST_HOOKS,
                                      "pytest.ini": "[pytest]\naddopts = -p no:python\n"}, 0.0,
                                     "tests/test_calc.py::test_add (failed)",
                                     ["conftest.py", "pytest.ini", "tests/conftest.py"]),
    "skip-from-the-code": ({"calc/__init__.py": CALC_BUGGY.replace("    return a - b\n", "    import pytest\n    pytest.skip('later')\n")},
                           0.0, "tests/test_calc.py::test_add (skipped)", []),
    "xfail-from-the-code": ({"calc/__init__.py": CALC_BUGGY.replace("    return a - b\n", "    import pytest\n    pytest.xfail('later')\n")},
                            0.0, "tests/test_calc.py::test_add (xfailed)", []),
    "replaced-runtest": ({"calc/__init__.py": "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n" + CALC_BUGGY},
                         0.0, "the tests' machinery was tampered with: changed class Function.runtest", []),
    "os-exit-mid-session": ({"calc/__init__.py": "import os\nos._exit(0)\n" + CALC_BUGGY}, 0.0,
                            "the test run ended without the runner's report (exit 0)", []),
}  # fmt: skip


@pytest.mark.parametrize(
    ("files", "reward", "reason", "touched"), list(PYTEST_CASES.values()), ids=list(PYTEST_CASES)
)
def test_pytest_tasks_are_graded_per_node_id_and_cannot_be_gamed(
    sandbox_pytest, tmp_path, files, reward, reason, touched
) -> None:
    tok = byte_chat_tokenizer()
    env = SweEnv(tok, max_turns=10, grade_timeout_s=60)
    [line] = try_episodes(env, [env.prompt(pytest_task(tmp_path))], ScriptedSampler(tok, {0: _writes(files)}))
    assert (line["reward"], line["touched_test_infra"]) == (reward, touched), line
    assert reason in line["reason"], line
