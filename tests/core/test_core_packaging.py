"""The distribution's shape: mapped product folders, no shadowing of the standard library, the CLI."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_operator_folder_does_not_shadow_the_standard_library() -> None:
    import operator

    assert Path(operator.__file__).parent != REPO / "operator"
    assert hasattr(operator, "itemgetter")
    product = importlib.import_module("rlfleet.operator")
    assert Path(product.__file__).parent == REPO / "operator"


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools_cfg = PYPROJECT["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    package_dir: dict[str, str] = setuptools_cfg["package-dir"]
    found: set[str] = set()
    for package, folder in package_dir.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root)
            found.add(".".join([package, *relative.parts]) if relative.parts else package)
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_cli_answers_without_heavy_imports(argv: list[str]) -> None:
    code = (
        f"import sys; from rlfleet.cli import main; rc = main({argv!r}); "
        "assert 'torch' not in sys.modules and 'kopf' not in sys.modules; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_cli_rejects_unknown_command_with_usage_and_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from rlfleet.cli import main; raise SystemExit(main(['frobnicate']))"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert result.returncode == 2
    assert "unknown command" in result.stderr
    assert "Traceback" not in result.stderr


def test_every_cli_command_module_exposes_cli() -> None:
    from rlfleet.cli import COMMANDS

    missing = []
    for words, (module_name, _) in COMMANDS.items():
        spec = importlib.util.find_spec(module_name)
        if spec is None:
            missing.append(" ".join(words))
            continue
        module = importlib.import_module(module_name)
        assert callable(getattr(module, "cli", None)), f"{module_name} has no cli(argv)"
    assert not missing, f"commands without a module: {missing}"
