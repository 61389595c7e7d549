"""scripts/bootstrap refuses a cold install onto a disk without room for it, in one line and before it
creates anything (pip's own "No space left on device" came minutes in, halfway through a venv: CI once
failed so after 144 s). `df` is the only thing replaced: a script first on PATH reporting the free space
the test sets, in df -Pk's columns; the bootstrap runs from a copy of itself in an empty checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bootstrap(
    tmp_path: Path, free_kib: int, tier: str, stamps: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "bootstrap", checkout / "scripts" / "bootstrap")
    for stamp in stamps:
        (checkout / stamp).parent.mkdir(parents=True, exist_ok=True)
        (checkout / stamp).touch()
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "df").write_text(
        "#!/bin/sh\n"
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "/dev/vda 264241152 200000000 {free_kib} 95% /"\n'
    )
    (shim / "df").chmod(0o755)
    return subprocess.run(
        ["bash", "scripts/bootstrap", tier],
        cwd=checkout,
        env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("tier", "stamps", "need"),
    [
        ("test", (), 16),  # the run tier, the test tier's rest, .venv312
        ("test", (".venv/.rlfleet-run-installed",), 8),  # after scripts/rlfleet: the rest and .venv312
        ("test", (".venv/.rlfleet-run-installed", ".venv/.rlfleet-installed"), 6),  # .venv312 only
        ("run", (), 8),
    ],
)
def test_a_cold_install_without_room_is_refused_in_one_line_before_anything_is_made(
    tmp_path: Path, tier: str, stamps: tuple[str, ...], need: int
) -> None:
    done = bootstrap(tmp_path, (need - 1) * 1024 * 1024, tier, stamps)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"scripts/bootstrap: {need - 1} GiB free on the disk of {tmp_path / 'checkout'} (df), and the {tier} "
        f"tier's install needs about {need} GiB (PyPI's torch brings its CUDA libraries); free some space and "
        "run it again"
    ]
    assert not (tmp_path / "checkout" / ".venv" / "bin").exists()


def test_an_installed_tier_is_not_held_to_it(tmp_path: Path) -> None:
    """The run tier's stamp and venv present (a stand-in `python`, never called): nothing is left to
    install, so a full disk stops nothing and the bootstrap is as quiet as on every `scripts/rlfleet`."""
    python = tmp_path / "checkout" / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    done = bootstrap(tmp_path, 0, "run", (".venv/.rlfleet-run-installed",))
    assert (done.returncode, done.stderr) == (0, "")
