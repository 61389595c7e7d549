"""The modules of tests/cluster/ (controlplane.py, kueue.py, ...) for pytest's side: each loaded by path
once, as `rlfleet_tests_<file>` (tests/cluster is no package, and the repository root must not go on
sys.path: ./operator would shadow the standard library's `operator`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CLUSTER_DIR = Path(__file__).resolve().parents[1] / "cluster"


def cluster_module(file: str) -> ModuleType:
    """tests/cluster/<file>.py, loaded on the first call."""
    name = f"rlfleet_tests_{file}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, CLUSTER_DIR / f"{file}.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
