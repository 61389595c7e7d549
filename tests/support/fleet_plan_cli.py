"""`rlfleet fleet plan FILE` as a real subprocess, from the repository's root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_fleet_plan(path: Path) -> subprocess.CompletedProcess[str]:
    """The plan of the request file `path` (JSON on stdout; exit 2 and one line on stderr when refused)."""
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "fleet", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
