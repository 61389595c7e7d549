"""Grading an SWE episode so that the agent's patch cannot fool it (docs/environments.md 'How grading
works'): the reward is 1 only if every required test is REPORTED as run and passed by a runner the
patch cannot replace, never from the test command's exit code.

In the fresh grading sandbox (the task's snapshot + the agent's diff):
1. every test file and every piece of test configuration in the tree (`is_test_infrastructure`:
   tests dirs, test modules, conftest.py, pytest.ini / tox.ini / setup.cfg / pyproject.toml,
   sitecustomize / usercustomize, *.pth, *.dist-info / *.egg-info, modules named like the test
   framework) is removed, and the snapshot's own are written back, with the hidden tests;
2. the runner (RUNNER, below) is given to `python3 -I` as its `-c` program: it never lives in the
   tree, and isolated mode ignores PYTHONPATH / PYTHONSTARTUP / the user site and never puts the
   tree first on sys.path (site reads .pth files and sitecustomize only from the interpreter's own
   site-packages, which the patch cannot reach): the tree is appended after the standard library
   and site-packages, so a `unittest.py`, `os.py` or `json.py` in it cannot stand in for the real one;
3. the runner reads a per-grading random nonce from its stdin (never in its argv or environment),
   installs an audit hook before any code of the tree runs (sys.settrace / sys.setprofile, gc's
   object walks, ctypes and /proc/*/mem are refused and recorded: they rewrite or read the grader's
   state), fingerprints the test framework, the builtins, the test classes and modules, checks that
   each test class and method comes from a snapshot test file and that no thread of the code under
   test runs once the tests are collected, runs each required test through unittest (its own result
   object) or pytest (its own plugin; no ini file, addopts, environment options or entry-point
   plugins: the task's test command only names the framework), and only after the last one writes ONE report
   line, `<nonce> {json}`, on a copy of stdout taken at its start, then leaves by os._exit (no atexit
   handler of the tree runs after it). An early exit (os._exit, sys.exit at import, a kill) leaves no
   report: reward 0.

What this does not stop: code under test that deliberately walks the grader's own stack frames
(sys._getframe / a traceback's frames are needed by logging and tracebacks, so they stay allowed) to
read the nonce and forge the report; and a function returning an object that equals everything (the
task's tests must check types). docs/environments.md lists each attack and what stops it.
"""

from __future__ import annotations

import ast
import io
import json
import re
import secrets
import shlex
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath

from rlfleet.sandbox import GIT_SAFE_ENV, SAFE_GIT, Sandbox

# test configuration a patch may not change: read by pytest (its ini files, pyproject's
# [tool.pytest.ini_options]), by site (sitecustomize / usercustomize / .pth) or by the frameworks'
# plugin discovery (a distribution's entry points)
TEST_CONFIG_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
        "noxfile.py",
    }
)
TEST_DIRS = frozenset({"tests", "test"})
FRAMEWORK_NAMES = frozenset(
    {"unittest", "pytest", "_pytest", "pluggy"}
)  # a top-level module named like the runner's
REPORT_TAIL_CHARS = 300
FAILED_LOAD = "unittest.loader._FailedTest."  # unittest's stand-in for a name it could not import


def is_test_infrastructure(path: str, hidden: Iterable[str] = ()) -> bool:
    """A test file or test configuration: what the grader restores from the snapshot and what the
    `test_infra_touched_rate` metric counts a patch touching."""
    p = PurePosixPath(path)
    name = p.name
    return (
        path in set(hidden)
        or any(part in TEST_DIRS for part in p.parts)
        or name in TEST_CONFIG_NAMES
        or name.endswith((".pth", ".dist-info", ".egg-info"))
        or (name.endswith(".py") and (name.startswith("test_") or p.stem.endswith("_test")))
        or (p.parts[0][:-3] if p.parts[0].endswith(".py") else p.parts[0]) in FRAMEWORK_NAMES
    )


@dataclass(frozen=True)
class GradeResult:
    reward: float
    reason: str


# The runner: a `python3 -I -c` program (Python >= 3.8: audit hooks). Its stdin: the nonce, then one
# JSON line {"names": [unittest names to load and run], "test_files": [the paths test classes may come from]}.
RUNNER = r"""
import sys, os, json
def _grade():
    write, exit_now, realpath = os.write, os._exit, os.path.realpath
    nonce = sys.stdin.buffer.readline().strip().decode()
    config = json.loads(sys.stdin.buffer.readline())
    out = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the tests read no more of the grader's stdin
    tampered = []
    armed = [False]
    def flag(what):
        if len(tampered) < 20 and what not in tampered:
            tampered.append(what)
    blocked = ("sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
               "ctypes.dlopen", "ctypes.dlsym", "ctypes.addressof", "ctypes.cdata", "sys._current_frames")
    def hook(event, args):
        if not armed[0]:
            return
        if event in blocked or (event == "open" and isinstance(args[0], str) and args[0].startswith("/proc/")
                                and args[0].rstrip("/").rsplit("/", 1)[-1] in ("mem", "environ")):
            flag(event + (" " + args[0] if event == "open" else ""))
            raise RuntimeError("the grader refuses " + event + " while it runs the tests")
    sys.addaudithook(hook)
    import threading
    def threads():  # every thread of the process, those started through _thread too (Linux's view)
        try:
            return len(os.listdir("/proc/self/task"))
        except OSError:
            return threading.active_count()
    import builtins, importlib.machinery, unittest, unittest.case, unittest.result, unittest.suite, unittest.loader
    use_pytest = config.get("framework") == "pytest"
    if use_pytest:  # only the grader's plugin: no entry-point plugin, no options from the environment
        for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
            os.environ.pop(name, None)
        os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        import pytest, _pytest.runner, _pytest.python, _pytest.reports, _pytest.main, _pytest.skipping, _pytest.outcomes
    root = realpath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p and realpath(p) != root] + [root]
    allowed_files = set(realpath(os.path.join(root, f)) for f in config["test_files"])
    source_loader = importlib.machinery.SourceFileLoader
    loader_types = (source_loader,)
    if use_pytest:  # pytest loads test modules through its assertion rewriter
        import _pytest.assertion.rewrite
        loader_types = (source_loader, _pytest.assertion.rewrite.AssertionRewritingHook)
    mutable = {"_classSetupFailed", "_class_cleanups", "tearDown_exceptions", "_abc_impl"}
    prints = []
    def fingerprint(name, space, keys=None):  # a test class: an added attribute (a setUp) counts too
        prints.append((name, space, keys, {k: id(v) for k, v in space.items() if (keys is None or k in keys) and k not in mutable}))
    def changes():
        for name, space, keys, ids in prints:
            now = {k: id(v) for k, v in space.items() if (keys is None or k in keys) and k not in mutable}
            for key in sorted(set(ids) | set(now)):
                if ids.get(key) != now.get(key) and (key in ids or name.startswith("test class ")):
                    flag("changed " + name.replace("test class ", "class ") + "." + key)
    for cls in (unittest.TestCase, unittest.TestResult, unittest.TestSuite, unittest.TestLoader,
                unittest.case._Outcome, unittest.case.SkipTest, unittest.FunctionTestCase):
        fingerprint("class " + cls.__qualname__, vars(cls))
    for module in (unittest, unittest.case, unittest.result, unittest.suite, unittest.loader, builtins):
        fingerprint(module.__name__, vars(module))
    if use_pytest:
        for cls in (pytest.Function, pytest.Item, pytest.Module, pytest.Class, _pytest.reports.TestReport, _pytest.runner.CallInfo):
            fingerprint("class " + cls.__qualname__, vars(cls))
        for module in (pytest, _pytest.runner, _pytest.python, _pytest.reports, _pytest.main, _pytest.skipping, _pytest.outcomes):
            fingerprint(module.__name__, vars(module))
    fingerprint("os", vars(os), {"_exit", "write", "kill", "abort"})
    fingerprint("sys", vars(sys), {"exit", "settrace", "setprofile", "addaudithook"})
    results = {}
    details = [20]  # the report stays small (it must fit the sandbox's output tail): the first 20 details
    def put(key, outcome, detail=""):
        if results.get(key, ("passed",))[0] == "passed" or outcome != "passed":
            keep = details[0] > 0 and outcome != "passed"
            details[0] -= keep
            results[key] = (outcome, str(detail)[-300:] if keep else "")
    class Recorder(unittest.TestResult):
        def addSuccess(self, test):
            put(test.id(), "passed")
        def addFailure(self, test, err):
            put(test.id(), "failed", self._exc_info_to_string(err, test))
        def addError(self, test, err):
            put(test.id(), "error", self._exc_info_to_string(err, test))
        def addSkip(self, test, reason):
            put(test.id(), "skipped", reason)
        def addExpectedFailure(self, test, err):
            put(test.id(), "xfailed")
        def addUnexpectedSuccess(self, test):
            put(test.id(), "xpassed")
        def addSubTest(self, test, subtest, err):
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                put(test.id(), "failed" if failed else "error", self._exc_info_to_string(err, test))
    fingerprint("class Recorder", vars(Recorder))
    def run_unittest():
        armed[0] = True
        suites = []
        loader = unittest.TestLoader()
        for name in config["names"]:
            try:
                suites.append(loader.loadTestsFromName(name))
            except BaseException as exc:  # sys.exit or an error at import: the name's tests did not run
                put(name, "error", "loading " + name + ": " + type(exc).__name__ + ": " + str(exc))
        def walk(suite):
            for test in suite:
                if isinstance(test, unittest.TestSuite):
                    yield from walk(test)
                else:
                    yield test
        tests = [t for s in suites for t in walk(s)]
        seen, modules_seen = set(), set()
        for test in tests:
            for cls in type(test).__mro__:
                if cls in seen or cls.__module__ in ("builtins", "unittest.case", "unittest.loader"):
                    continue
                seen.add(cls)
                module = sys.modules.get(cls.__module__)
                spec = getattr(module, "__spec__", None)
                origin = realpath(spec.origin) if spec is not None and spec.origin else ""
                if type(getattr(spec, "loader", None)) is not source_loader or origin not in allowed_files:
                    flag("the test class " + cls.__qualname__ + " comes from " + (origin or repr(module)))
                fingerprint("test class " + cls.__qualname__, vars(cls))
                if module is not None and cls.__module__ not in modules_seen:
                    modules_seen.add(cls.__module__)
                    fingerprint(cls.__module__, vars(module))
            method = getattr(type(test), getattr(test, "_testMethodName", ""), None)
            code = getattr(method, "__code__", None)
            if code is not None and (realpath(code.co_filename) not in allowed_files
                                     or getattr(code, "co_qualname", code.co_name).rsplit(".", 1)[-1] != test._testMethodName):
                flag("the test method " + test.id() + " is not the test file's")
        if threads() > 1:  # a thread of the code under test could swap a test after these checks
            flag("a thread of the code under test was running when the tests were collected")
        recorder = Recorder()
        for test in tests:
            try:
                test(recorder)
            except BaseException as exc:
                put(test.id(), "error", type(exc).__name__ + ": " + str(exc))
            changes()
    def check_origin(module, what, code):
        spec = getattr(module, "__spec__", None)
        origin = realpath(spec.origin) if spec is not None and spec.origin else ""
        if type(getattr(spec, "loader", None)) not in loader_types or origin not in allowed_files:
            flag(what + " comes from " + (origin or repr(module)))
        if code is not None and realpath(code.co_filename) not in allowed_files:
            flag(what + " is not the test file's")
    if use_pytest:
        run_pytest(pytest, config, root, put, flag, fingerprint, changes, check_origin, threads, armed)
    else:
        run_unittest()
    armed[0] = False
    report = json.dumps({"results": {k: list(v) for k, v in results.items()}, "tampered": tampered})
    data = ("\n" + nonce + " " + report + "\n").encode()
    while data:
        data = data[write(out, data):]
    exit_now(0)
def run_pytest(pytest, config, root, put, flag, fingerprint, changes, check_origin, threads, armed):
    import sys
    class Recorder:
        def pytest_collectreport(self, report):
            if report.failed:
                put(report.nodeid or "<collection>", "error", str(report.longrepr))
        def pytest_collection_finish(self, session):
            seen = set()
            for item in session.items:
                module = getattr(item, "module", None)
                if module is not None and module.__name__ not in seen:
                    seen.add(module.__name__)
                    check_origin(module, "the test module " + module.__name__, None)
                    fingerprint(module.__name__, vars(module))
                function = getattr(item, "function", None)
                check_origin(module, "the test " + item.nodeid, getattr(function, "__code__", None))
                cls = getattr(item, "cls", None)
                if cls is not None and ("class", cls) not in seen:
                    seen.add(("class", cls))
                    fingerprint("test class " + cls.__qualname__, vars(cls))
            if threads() > 1:
                flag("a thread of the code under test was running when the tests were collected")
        def pytest_runtest_logreport(self, report):
            if report.when == "call" or report.failed or report.skipped:
                if hasattr(report, "wasxfail"):
                    outcome = "xfailed" if report.skipped else "xpassed"
                elif report.when != "call" and report.failed:
                    outcome = "error"
                else:
                    outcome = report.outcome
                put(report.nodeid, outcome, str(report.longrepr or "") if outcome != "passed" else "")
        def pytest_runtest_logfinish(self, nodeid, location):
            changes()
    armed[0] = True
    args = [*config["names"], "-c", "/dev/null", "--rootdir", root, "-p", "no:cacheprovider", "-p", "no:stepwise",
            "--import-mode=append", "-o", "addopts=", "-q", "-rN"]
    try:
        pytest.main(args, plugins=[Recorder()])
    except BaseException as exc:  # an exit from the code under test while pytest ran
        put("<session>", "error", type(exc).__name__ + ": " + str(exc))
_grade()
"""


def runner_command(python: str = "python3") -> str:
    """The shell command that runs RUNNER: a `-c` program, so nothing of it is in the tree."""
    return f"exec {python} -I -c {shlex.quote(RUNNER)}"


PYTEST_COMMAND = re.compile(r"(py\.test|pytest|python[0-9.]* -m pytest)( .*)?")
UNITTEST_COMMAND = re.compile(r"python[0-9.]* -m unittest( .*)?")
UNITTEST_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PYTEST_NODE_ID = re.compile(r"[^\s:]+\.py(::\S.*)?")


def test_framework(command: str) -> str | None:
    """ "pytest" or "unittest": the framework a test command runs (the grader runs it itself), None: neither."""
    command = " ".join(command.split())
    if PYTEST_COMMAND.fullmatch(command):
        return "pytest"
    return "unittest" if UNITTEST_COMMAND.fullmatch(command) else None


def test_name_error(name: str, framework: str) -> str | None:
    """Why `name` is not a test name the framework's runner loads (None: it is)."""
    if framework == "pytest":
        return (
            None
            if PYTEST_NODE_ID.fullmatch(name)
            else f"{name!r} is not a pytest node id (path/to/test_x.py::test_y)"
        )
    return (
        None
        if UNITTEST_NAME.fullmatch(name)
        else f"{name!r} is not a unittest name (module.Class.test_method)"
    )


def test_module(path: str) -> str | None:
    """The dotted module of a test file (None: not a .py test module importable by name)."""
    p = PurePosixPath(path)
    parts = [*p.parts[:-1], p.stem]
    ok = p.suffix == ".py" and is_test_infrastructure(path) and p.name != "conftest.py"
    return ".".join(parts) if ok and all(part.isidentifier() for part in parts) else None


@dataclass(frozen=True)
class GradingPlan:
    framework: str  # "unittest" or "pytest"
    names: list[str]  # what the runner loads and runs
    required: list[str]  # what must be reported passed (a name covers the tests under it)
    test_files: list[str]  # the files test classes may come from


def grading_plan(
    files: Mapping[str, str],
    hidden: Mapping[str, str],
    test_patch_paths: list[str],
    named: list[str],
    protected: set[str],
    framework: str,
) -> GradingPlan:
    """Named tests (FAIL_TO_PASS + PASS_TO_PASS) if the task has them, else every test of its hidden
    test files, at least the ones their top-level classes (and, for pytest, functions) define."""
    test_files = sorted(
        p
        for p in {*files, *hidden, *test_patch_paths}
        if p.endswith(".py") and is_test_infrastructure(p, protected)
    )
    if named:
        return GradingPlan(framework, list(named), list(named), test_files)
    pytest = framework == "pytest"
    modules = {path: m for path in [*hidden, *test_patch_paths] if (m := test_module(path)) is not None}
    names = list(dict.fromkeys(modules if pytest else modules.values()))
    static = [
        i
        for path, source in hidden.items()
        if path in modules
        for i in static_test_ids(path if pytest else modules[path], source, pytest)
    ]
    return GradingPlan(framework, names, names + static, test_files)


def static_test_ids(module: str, source: str, pytest: bool = False) -> list[str]:
    """The test ids a hidden test file defines at its top level (unittest: TestCase-like classes' test*
    methods; pytest: test* functions and Test* classes' test* methods), read without importing it: the
    runner must report each of them, so code under test that deletes a test before it is collected earns 0."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    sep = "::" if pytest else "."
    ids = []
    for node in tree.body:
        if (
            pytest
            and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")
        ):
            ids.append(f"{module}::{node.name}")
        if isinstance(node, ast.ClassDef) and (node.name.startswith("Test") if pytest else bool(node.bases)):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    ids.append(f"{module}{sep}{node.name}{sep}{item.name}")
    return ids


def parse_report(output: str, nonce: str) -> dict[str, object] | str:
    """The runner's report: the one line that starts with the nonce; else why there is none."""
    lines = [line for line in output.splitlines() if line.startswith(nonce + " ")]
    if len(lines) > 1:  # a fork of the runner reported too: which one ran the tests is unknown
        return f"the test run wrote {len(lines)} reports (a forked copy of the runner went on)"
    try:
        report = json.loads(lines[0][len(nonce) + 1 :]) if lines else None
    except json.JSONDecodeError:
        report = None
    return report if isinstance(report, dict) else "the test run ended without the runner's report"


def verdict(report: Mapping[str, object], required: list[str]) -> GradeResult:
    """1 only if every required name (a test id, or a class or module: each of its tests) was reported
    run and passed, no test failed to load, and nothing was tampered with."""
    tampered = report.get("tampered")
    if tampered:
        what = ", ".join(map(str, tampered)) if isinstance(tampered, list) else str(tampered)
        return GradeResult(0.0, f"the tests' machinery was tampered with: {what[:300]}")
    raw = report.get("results")
    results = {str(k): v for k, v in raw.items()} if isinstance(raw, dict) else {}
    problems = [
        f"{k} (error)"
        for k, v in results.items()
        if k.startswith(FAILED_LOAD)
        or k.startswith("<")
        or (v[0] == "error" and not k.startswith(tuple(required)))
    ]
    for name in required:
        mine = {
            k: v
            for k, v in results.items()
            if k == name or k.startswith((name + ".", name + "::", name + "["))
        }
        if not mine:
            problems.append(f"{name} (not run)")
        problems += [f"{k} ({v[0]})" for k, v in mine.items() if v[0] != "passed"]
    problems = list(dict.fromkeys(problems))
    if not problems:
        return GradeResult(1.0, "the hidden tests passed")
    detail = next((str(v[1]) for v in results.values() if v[0] != "passed" and v[1]), "")
    tail = f": {detail.strip()[-REPORT_TAIL_CHARS:]}" if detail else ""
    return GradeResult(0.0, f"not every required test ran and passed: {', '.join(problems)[:400]}{tail}")


def restore_test_infrastructure(
    box: Sandbox, pristine: Mapping[str, str], hidden: Mapping[str, str], protected: set[str]
) -> str | None:
    """Remove every test file and test configuration the tree holds now (after the agent's diff), then
    write the snapshot's own back with the hidden tests. None, or why the tree cannot be graded."""
    listing = box.run("find . -path ./.git -prune -o -mindepth 1 -printf '%y %P\\0'", timeout_s=60)
    if listing.exit_code != 0:
        return f"cannot list the patched tree: {listing.output.strip()[-300:]}"
    if re.search(
        r"\n\[\.\.\. \d+ bytes omitted \.\.\.\]\n", listing.output
    ):  # the sandbox cut a huge listing
        return "the patched tree has too many paths to list (over 1 MiB of names)"
    entries = [e for e in listing.output.split("\0") if e]
    if any("\ufffd" in e for e in entries):
        return "the patch adds a path that is not UTF-8"
    kinds = {e[2:]: e[0] for e in entries if e[2:] != ".git"}
    restore = {p: c for p, c in pristine.items() if is_test_infrastructure(p, protected)} | dict(hidden)
    doomed = {p for p in kinds if is_test_infrastructure(p, protected)}
    for path in restore:  # a symlink or a file where a restored file's directory must be
        parents = PurePosixPath(path).parents
        doomed |= {str(a) for a in parents if str(a) in kinds and kinds[str(a)] != "d" and str(a) != "."}
    tar = io.BytesIO()
    with tarfile.open(fileobj=tar, mode="w") as archive:
        for path, content in sorted(restore.items()):
            data = content.encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    removed = box.run(
        "xargs -0 -r rm -rf --", timeout_s=60, stdin="".join(p + "\0" for p in sorted(doomed)).encode()
    )
    done = (
        removed
        if removed.exit_code != 0
        else box.run("tar -x --no-same-owner -f -", timeout_s=60, stdin=tar.getvalue())
    )
    if done.exit_code != 0:
        return f"cannot restore the test files: {done.output.strip()[-300:]}"
    return None


def new_nonce() -> str:
    return secrets.token_hex(16)


def git_apply(box: Sandbox, diff: str) -> tuple[int, str]:
    """`git apply` with no configuration the patch could bring (it never reaches .git, but a tree's
    .gitattributes could)."""
    result = box.run(
        f"{GIT_SAFE_ENV} {' '.join(SAFE_GIT)} apply --binary -", timeout_s=60, stdin=diff.encode()
    )
    return result.exit_code, result.output
