"""scripts/dev-cluster: a one-machine Kubernetes cluster with a real node, to try the operator without
GPUs (docs/dev-cluster.md). The control plane of controlplane.py, kwok's fake GPU nodes for scheduling,
and one real CPU node (realnode.py) whose pods run for real, from images built here (nodeimages.py).

    scripts/dev-cluster up                 # prints the KUBECONFIG path
    scripts/dev-cluster images [NAME ...]  # build operator, sampler, trainer (CPU) and load them into the node
    scripts/dev-cluster status
    scripts/dev-cluster down               # no process, mount, bridge or iptables rule left
    scripts/dev-cluster prepare            # only install, build and cache (scripts/test runs it before pytest)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import controlplane  # noqa: E402 - this folder, put on sys.path just above
import nodeimages  # noqa: E402
import realnode  # noqa: E402

WORKDIR = controlplane.WORK_ROOT / "dev-cluster"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Busy(Exception):
    """Another `up` holds the work dir's lock (the message names it)."""


def lock_path(workdir: Path) -> Path:
    """Beside the work dir, not in it: `up` empties the work dir before it starts."""
    return workdir.parent / f"{workdir.name}.lock"


def take_up_lock(workdir: Path) -> int:
    """An exclusive flock on the work dir's lock file, held (its fd open) until this `up` exits: a second
    `up` while the first installs, builds or starts is refused at once instead of emptying the work dir
    under it. The holder's pid is written into the file for that refusal to name. The kernel drops the
    lock when the holder exits, however it exits: no stale lock to clean up."""
    path = lock_path(workdir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise Busy(f"cannot open the dev cluster's lock {path}: {err.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise Busy(
            f"another scripts/dev-cluster up (pid {holder}) is starting the dev cluster in {workdir} "
            f"(it holds {path}); wait for it, or stop it with scripts/dev-cluster down"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def cmd_up(workdir: Path) -> int:
    """The lock first, before anything that needs root or touches the host: a refusal needs neither."""
    try:
        take_up_lock(workdir)  # held until this process exits (the supervisor it starts is then up)
    except Busy as err:
        log(f"error: {err}")
        return 2
    problems = realnode.host_problems()
    if problems:
        log(f"error: this machine cannot run the real node: {'; '.join(problems)}")
        return 2
    realnode.ensure_host_packages(log)
    return controlplane.cmd_up(workdir, foreground=False, real_node=True, timeout=900)


def cmd_images(workdir: Path, names: list[str]) -> int:
    if not (workdir / "state.json").exists():
        log("error: the dev cluster is not running (scripts/dev-cluster up)")
        return 1
    built = nodeimages.build_all(names, log=log)
    node = realnode.RealNode(workdir, log)
    node.load_images(built)
    for image in built:
        print(image.ref)
    (workdir / "images.json").write_text(
        json.dumps(
            {
                b.name: {"ref": b.ref, "archive": str(b.archive), "build_seconds": round(b.seconds, 1)}
                for b in built
            },
            indent=2,
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/dev-cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=WORKDIR)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start the control plane and the real node; prints the KUBECONFIG path")
    p_images = sub.add_parser("images", help="build the CPU images and load them into the node")
    p_images.add_argument(
        "names", nargs="*", default=list(nodeimages.CPU_TAGS), help="operator, sampler, trainer"
    )
    sub.add_parser("status", help="is it running? lists the nodes")
    sub.add_parser("down", help="stop it; leaves no process, mount, bridge or iptables rule")
    sub.add_parser(
        "prepare", help="install the Debian packages, build the binaries and images (cached); start nothing"
    )
    args = parser.parse_args(argv)
    workdir = args.workdir.resolve()
    try:
        if args.command == "up":
            return cmd_up(workdir)
        if args.command == "images":
            unknown = sorted(set(args.names) - set(nodeimages.CPU_TAGS))
            if unknown:
                log(f"error: unknown image(s) {unknown}; known: {sorted(nodeimages.CPU_TAGS)}")
                return 2
            return cmd_images(workdir, args.names)
        if args.command == "prepare":
            realnode.ensure_host_packages(log)
            # images first: scripts/test runs the Go builds in the background meanwhile
            nodeimages.build_all(log=log)
            controlplane.build(controlplane.CONTROL_PLANE_COMPONENTS + controlplane.NODE_COMPONENTS, log=log)
            return 0
        if args.command == "status":
            return controlplane.cmd_status(workdir)
        return controlplane.cmd_down(workdir)
    except (
        controlplane.BuildError,
        controlplane.ControlPlaneError,
        realnode.NodeError,
        nodeimages.ImageError,
    ) as err:
        log(f"error: {err}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
