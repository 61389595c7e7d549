"""SWE-bench-style task files: a JSONL read with HF `datasets` (`load_dataset("json")`), one
instance a row with SWE-bench's field names, mapped to `SweTask` (trainer/envs/swe_env.py). The steps
from such a file to `rlfleet env try` and to an RLJob are in docs/environments.md 'SWE-bench-style
tasks'.

A row (other fields are not used: `repo`, `version`, `created_at`, `hints_text`, and `patch`, the
reference fix, never shown to the agent nor used to grade):
- `instance_id`, `problem_statement` (the task statement), `base_commit` (picks the snapshot);
- `test_patch`: the diff that adds the hidden tests, applied in the fresh grading sandbox after the
  agent's diff;
- `FAIL_TO_PASS`, `PASS_TO_PASS`: test ids, as JSON-encoded lists (SWE-bench's own files, and
  `swebench.harness.utils.make_test_spec`'s convention) or lists;
- `test_command`: `python3 -m unittest` or `pytest` (+ the ids: how the agent may run them); the
  grader runs the ids through its own runner of that framework (trainer/envs/swe_grade.py), so the ids
  are unittest names (`tests.test_calc.CalcTest.test_add`) or pytest node ids
  (`tests/test_calc.py::test_add`), and the reward is 1 iff each is reported run and passed;
- where the repository comes from, exactly one of: `repo_path` (a local git repository holding
  `base_commit`, whose tree at that commit is the snapshot; or a plain directory, taken as it is;
  relative to the JSONL's directory) or `image` (a container image for a cluster sandbox; the
  local sandbox refuses such a task).
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlfleet.trainer.envs.swe_env import SweTask
from rlfleet.trainer.envs.swe_grade import test_framework, test_name_error

MODULE_HELP = "convert a SWE-bench-style JSONL to an SWE task file (a prompt set for SweEnv)"
SWE_BENCH_FIELDS = frozenset({"problem_statement", "base_commit", "FAIL_TO_PASS"})  # a row with these is one


class SweBenchRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    instance_id: str = Field(min_length=1)
    base_commit: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    test_patch: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = []
    test_command: str = Field(min_length=1)
    test_timeout_s: float = Field(default=60.0, gt=0)
    repo_path: str | None = None
    image: str | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def json_encoded_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"a JSON-encoded list of test ids, not JSON ({exc.msg})") from None
        return value

    @field_validator("test_command")
    @classmethod
    def runs_a_known_framework(cls, value: str) -> str:
        if test_framework(value) is None:
            raise ValueError(
                f"{value!r}: the grader runs unittest or pytest; give `python3 -m unittest` or `pytest`"
            )
        return value

    @model_validator(mode="after")
    def one_repository_source(self) -> SweBenchRow:
        if (self.repo_path is None) == (self.image is None):
            raise ValueError("give exactly one of repo_path (a local snapshot) and image (a container image)")
        framework = test_framework(self.test_command) or "unittest"
        for field, names in (("FAIL_TO_PASS", self.FAIL_TO_PASS), ("PASS_TO_PASS", self.PASS_TO_PASS)):
            for name in names:
                if (error := test_name_error(name, framework)) is not None:
                    raise ValueError(f"{field}: {error}: the grader runs {framework}")
        return self

    def test_ids_command(self) -> str:
        return " ".join(
            [self.test_command, *(shlex.quote(t) for t in [*self.FAIL_TO_PASS, *self.PASS_TO_PASS])]
        )


def is_swe_bench_file(path: Path) -> bool:
    """Whether the JSONL's first row has SWE-bench's fields (else it is a file of `SweTask.row()`s)."""
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(row, dict) and SWE_BENCH_FIELDS <= set(row)
    return False


def snapshot_files(repo_path: Path, base_commit: str) -> dict[str, str]:
    """The repository's text files: a git repository's tree at `base_commit`, else the directory as
    it is. The snapshot is text (`SweTask.files`): a binary file is refused, naming it."""
    if not repo_path.is_dir():
        raise ValueError(f"repo_path {str(repo_path)!r} is not a directory")
    files: dict[str, bytes] = {}
    if (repo_path / ".git").exists():
        archive = subprocess.run(
            ["git", "-C", str(repo_path), "archive", "--format=tar", f"{base_commit}^{{commit}}"],
            capture_output=True,
        )
        if archive.returncode != 0:
            raise ValueError(
                f"base_commit {base_commit!r} is not a commit of {str(repo_path)!r}: "
                f"{archive.stderr.decode(errors='replace').strip()[-300:]}"
            )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            for member in tar.getmembers():
                reader = tar.extractfile(member) if member.isfile() else None
                if reader is not None:
                    files[member.name] = reader.read()
    else:
        for p in sorted(repo_path.rglob("*")):
            if p.is_file() and not p.is_symlink():
                files[p.relative_to(repo_path).as_posix()] = p.read_bytes()
    text: dict[str, str] = {}
    for name, data in files.items():
        try:
            text[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                f"{name} in {str(repo_path)!r} is not UTF-8 text: the snapshot holds text files only"
            ) from None
    return text


def to_task(row: SweBenchRow, base_dir: Path) -> SweTask:
    files: dict[str, str] = {}
    if row.repo_path is not None:
        files = snapshot_files(base_dir / row.repo_path, row.base_commit)
    return SweTask(
        instance_id=row.instance_id,
        statement=row.problem_statement,
        files=files,
        hidden_tests={},
        test_command=row.test_ids_command(),
        test_timeout_s=row.test_timeout_s,
        test_patch=row.test_patch,
        image=row.image,
        fail_to_pass=tuple(row.FAIL_TO_PASS),
        pass_to_pass=tuple(row.PASS_TO_PASS),
    )


def _field_errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'row'}: {e['msg']}" for e in exc.errors())


def load_swe_bench(path: str | Path) -> list[SweTask]:
    """The tasks of a SWE-bench-style JSONL; a bad row is a one-line error naming its row (1-based),
    its instance id and the field."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the CLIs' stderr is their one-line errors
    try:
        data = datasets.load_dataset("json", data_files=str(path), split="train")
    except Exception as exc:  # datasets wraps parser errors in several exception types
        raise ValueError(f"{path}: cannot be read as JSONL: {str(exc).splitlines()[0]}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    tasks = []
    for i, raw in enumerate(data, start=1):
        where = f"{path} row {i}" + (f" ({raw['instance_id']})" if raw.get("instance_id") else "")
        try:
            row = SweBenchRow.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"{where}: {_field_errors(exc)}") from None
        try:
            tasks.append(to_task(row, path.parent))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return tasks


def cli(argv: list[str]) -> int:
    """`rlfleet env swe-bench FILE --out TASKS`: a SWE-bench-style JSONL as a task file (`SweTask.row()`
    lines, each snapshot inside its row): a prompt set for an RLJob's `rollout.dataset`."""
    parser = argparse.ArgumentParser(prog="rlfleet env swe-bench", description=MODULE_HELP)
    parser.add_argument("swe_bench", type=Path, help="the SWE-bench-style JSONL")
    parser.add_argument("--out", type=Path, required=True, help="the task file to write")
    args = parser.parse_args(argv)
    try:
        tasks = load_swe_bench(args.swe_bench)
        args.out.write_text("".join(json.dumps(t.row(), sort_keys=True) + "\n" for t in tasks))
    except (ValueError, OSError) as exc:
        print(f"rlfleet env swe-bench: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(tasks)} tasks")
    return 0
