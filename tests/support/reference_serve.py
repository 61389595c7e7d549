"""`rlfleet sampler serve --engine reference`: the project's reference sampler server as a command line."""

from __future__ import annotations

from pathlib import Path

SERVE_REFERENCE = ["sampler", "serve", "--engine", "reference"]
"""Its arguments after the program (`rlfleet` in a pod, `python -m rlfleet.cli` in a test)."""


def serve_reference_argv(port_file: Path, *flags: str) -> list[str]:
    """Its arguments for a server on a free port that it writes into `port_file`, then `flags`."""
    return [*SERVE_REFERENCE, "--port", "0", "--port-file", str(port_file), *flags]
