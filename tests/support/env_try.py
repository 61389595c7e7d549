"""`rlfleet env try --environment swe` run as a user runs it: the real CLI entry, a subprocess."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ENV_TRY_SWE = [sys.executable, "-m", "rlfleet.cli", "env", "try", "--environment", "swe"]


def env_try_swe(tasks: Path, policy: Path) -> subprocess.CompletedProcess[str]:
    """The finished command with its stdout and stderr as text (nothing is checked here)."""
    return subprocess.run(
        [*ENV_TRY_SWE, "--tasks", str(tasks), "--policy", str(policy)],
        capture_output=True,
        text=True,
        timeout=300,
    )
