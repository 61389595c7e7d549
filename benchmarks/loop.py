"""Local-mode training loop throughput: steps/s and where the wall time goes (sampling vs training).

    .venv/bin/python benchmarks/loop.py [--steps 8] [--groups 2|8] [--environment tool_add|copy_digit]

Runs `rlfleet run examples/rljob.yaml --local` in this process (real fleet-host subprocess with the
reference sampler servers, router and weight sync; trainer here), then prints per-step means of the
loop's own timers: `time/wait_rollouts` (the trainer waiting for complete prompt groups, i.e. sampling
that did not overlap training), `time/train` (forward + backward + optimizer), `time/publish`
(checkpoint + weight views + channel). Ratios, not absolute times, are the result: the shares of a
step, and a step relative to the train-only time measured on the same batches in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, choices=(2, 8))
    p.add_argument("--environment", default="tool_add")
    args = p.parse_args(argv)

    from rlfleet.api import load_rljob
    from rlfleet.trainer.local import resolve_run, run_local

    doc = yaml.safe_load((REPO / "examples" / "rljob.yaml").read_text())
    if args.groups == 2:
        doc["spec"]["samplerGroups"] = [
            {"name": "h100-bf16", "accelerator": "h100", "replicas": 1, "weightFormat": "bf16"},
            {"name": "b200-nvfp4", "accelerator": "b200", "replicas": 1, "weightFormat": "nvfp4"},
        ]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "rljob.yaml"
        manifest.write_text(yaml.safe_dump(doc))
        rc = resolve_run(load_rljob(manifest), local=True)
        rc.steps, rc.environment = args.steps, args.environment
        summary = run_local(rc, Path(tmp) / "run", live=False)
        import json

        rows = json.loads((Path(tmp) / "run" / "report" / "metrics.json").read_text())["steps"]
    rows = rows[1:]  # step 1 includes the fleet's first weight load and warm-up
    wait = statistics.mean(r["time/wait_rollouts"] for r in rows)
    train = statistics.mean(r["time/train"] for r in rows)
    publish = statistics.mean(r["time/publish"] for r in rows)
    step = wait + train + publish
    tokens = statistics.mean(r["trained_tokens"] for r in rows)
    print(f"groups={args.groups} environment={args.environment} steps={summary['steps']} (first step excluded)")
    print(f"steps/s                    {1 / step:.3f}")
    print(f"trained tokens/s           {tokens / step:.0f}")
    print(f"share waiting for rollouts {wait / step:.1%}")
    print(f"share training             {train / step:.1%}")
    print(f"share publishing           {publish / step:.1%}")
    print(f"step / train-only          {step / train:.1f}x")
    print(f"reward first -> last       {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
