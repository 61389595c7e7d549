"""The `rlfleet` command line.

One dispatcher, lazy imports: each subcommand lives in the module that owns it and exposes
`cli(argv: list[str]) -> int` built with argparse. Importing the CLI never imports torch or kopf,
so `rlfleet --help` is instant and works in every image.
"""

from __future__ import annotations

import importlib
import sys

# command words -> (module, one-line help). The module's `cli(argv)` parses the rest.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("run",): ("rlfleet.trainer.local", "run an RLJob manifest (--local: everything on this machine)"),
    ("ablate",): ("rlfleet.trainer.ablation", "run the correction ablation (pg, mis, sc, sc_mis, +top-p)"),
    ("model", "tiny-qwen3"): ("rlfleet.tiny_qwen3", "write the project's tiny Qwen3 HF checkpoint (tests, local runs)"),
    ("crds",): ("rlfleet.api.crdgen", "write (or --check) the CRD YAML generated from the API models"),
    ("operator", "run"): ("rlfleet.operator.main", "run the operator (in or out of a cluster)"),
    ("sampler", "serve"): ("rlfleet.sampler.server", "serve a sampler (--engine reference | sglang)"),
    ("sampler", "sync"): ("rlfleet.sampler.sync", "weight-sync sidecar: reconcile an engine to the channel"),
    ("router", "serve"): ("rlfleet.router.service", "serve the session-affine weighted router"),
    ("trainer", "run"): ("rlfleet.trainer.entrypoint", "trainer pod entrypoint (rank 0 drives rollouts)"),
}


def _usage() -> str:
    lines = ["usage: rlfleet <command> [options]", "", "commands:"]
    for words, (_, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    lines.append("")
    lines.append("`rlfleet <command> --help` shows the options of a command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from rlfleet import __version__

        print(__version__)
        return 0
    for words, (module_name, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[: len(words)]) == words:
            module = importlib.import_module(module_name)
            return int(module.cli(args[len(words) :]) or 0)
    print(f"rlfleet: unknown command {' '.join(args[:2])!r}\n", file=sys.stderr)
    print(_usage(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
