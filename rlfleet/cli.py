"""The `rlfleet` command line.

One dispatcher, lazy imports: each subcommand lives in the module that owns it and exposes
`cli(argv: list[str]) -> int` built with argparse. Importing the CLI never imports torch or kopf,
so `rlfleet --help` is instant and works in every image.

Commands of other installed distributions come from the `rlfleet.commands` entry-point group (name:
the command words, value: the module with `cli(argv)`): `rlfleet ablate` is the experiments' command
(experiments/pyproject.toml), present where they are installed (.venv), absent from the images,
and never imported or named here.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from pathlib import Path
from typing import NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    """A subcommand's parser whose bad input is one clear line on stderr and exit 2 (no usage dump, no
    stack trace): the sidecar's and the slime bridge's, whose lines end in a pod's log."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# command words -> (module, one-line help). The module's `cli(argv)` parses the rest.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("run",): ("rlfleet.local.main", "run an RLJob manifest (--local: everything on this machine)"),
    ("model", "tiny-qwen3"): (
        "rlfleet.trainer.warm_start",
        "write the project's tiny Qwen3 HF checkpoint (tests, local runs)",
    ),
    ("crds",): ("rlfleet.api.crdgen", "write (or --check) the CRD YAML generated from the API models"),
    ("operator", "run"): ("rlfleet.operator.main", "run the operator (in or out of a cluster)"),
    ("sampler", "serve"): ("rlfleet.sampler.server", "serve a sampler (--engine reference | sglang)"),
    ("sampler", "sync"): ("rlfleet.sampler.sync", "weight-sync sidecar: reconcile an engine to the channel"),
    ("router", "serve"): ("rlfleet.router.service", "serve the session-affine weighted router"),
    ("trainer", "run"): ("rlfleet.trainer.entrypoint", "trainer pod entrypoint (rank 0 drives rollouts)"),
    ("trainer", "launch"): (
        "rlfleet.trainer.launch",
        "torchrun, exiting with the failed rank's own code (the trainer pod's command)",
    ),
    ("env", "try"): (
        "rlfleet.trainer.env_try",
        "run an environment's episodes with a scripted policy (JSON lines)",
    ),
    ("env", "swe-bench"): (
        "rlfleet.trainer.envs.swe_bench",
        "convert a SWE-bench-style JSONL to an SWE task file (a prompt set)",
    ),
    ("slime", "bridge"): (
        "rlfleet.trainer.slime_bridge",
        "publish slime's disk weight versions (full or delta) into a weight channel",
    ),
    ("fleet", "plan"): (
        "rlfleet.fleet",
        "replicas and shares per group at the least cost per usable token (JSON)",
    ),
}


PLUGIN_GROUP = "rlfleet.commands"


def plugin_commands() -> dict[tuple[str, ...], tuple[str, str]]:
    """The commands other installed distributions add (the entry-point group `rlfleet.commands`),
    in the shape of COMMANDS; the help text names the distribution (its module is not imported)."""
    from importlib.metadata import entry_points

    out: dict[tuple[str, ...], tuple[str, str]] = {}
    for ep in entry_points(group=PLUGIN_GROUP):
        words = tuple(ep.name.split())
        if words not in COMMANDS:  # the product's own commands are never replaced
            out[words] = (ep.value, f"(from {ep.dist.name if ep.dist else ep.value})")
    return out


def invocation() -> list[str]:
    """The words that run this CLI again from the same working directory, for hints a command prints
    (a resume command): `python -m rlfleet.cli` as `<this python> -m rlfleet.cli`; a console script
    by the path it was started with (`.venv/bin/rlfleet`, or the absolute one `scripts/rlfleet` execs),
    shortened to `rlfleet` only where that name on PATH is the same file."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "rlfleet"
    if argv0.endswith(".py") or argv0 == "-m":  # python -m rlfleet.cli: argv[0] is the module's file
        return [sys.executable, "-m", "rlfleet.cli"]
    on_path = shutil.which("rlfleet")
    if on_path is not None and Path(on_path).resolve() == Path(argv0).resolve():
        return ["rlfleet"]
    return [argv0]


def _usage(commands: dict[tuple[str, ...], tuple[str, str]]) -> str:
    lines = ["usage: rlfleet <command> [options]", "", "commands:"]
    for words, (_, help_text) in commands.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    lines.append("")
    lines.append("`rlfleet <command> --help` shows the options of a command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    commands = COMMANDS | plugin_commands()  # the product's first: plugins follow in the usage
    if not args or args[0] in ("-h", "--help"):
        print(_usage(commands))
        return 0
    if args[0] == "--version":
        from rlfleet import __version__

        print(__version__)
        return 0
    for words, (module_name, _) in sorted(commands.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[: len(words)]) == words:
            module = importlib.import_module(module_name)
            return int(module.cli(args[len(words) :]) or 0)
    print(f"rlfleet: unknown command {' '.join(args[:2])!r}\n", file=sys.stderr)
    print(_usage(commands), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
