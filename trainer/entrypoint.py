"""`rlfleet trainer run --config /etc/rlfleet/run/rljob.yaml`: the trainer pod's entrypoint (under torchrun).

Reads the resolved RLJob the operator wrote into the ConfigMap; cluster endpoints come from the env the
operator sets (RLFLEET_ROUTER_URL, store credentials by reference). Global rank
0 drives everything: rollouts through the router, the loop, publishing to the weight channel, the
Prometheus exporter (`rlfleet_trainer_*`, scope=group/view/staleness: the rebalancer reads the
per-group KL/OOR from it), checkpoints next to the channel (`<channel path>/checkpoints`, or `checkpoints/` under an S3
channel's prefix). The model comes from `spec.model.path` through rlfleet/model_source.py, and
trainer/run.py (the one composition root, shared with local mode and the ablation) publishes version 0
of every view from it before step 1: sampler groups wait for it before their engines start. The trainer has NO Kubernetes API rights
(its pods do not mount a ServiceAccount token): step, published weight version, fleet metrics and the
collapse detector's state (`rlfleet_trainer_collapse_risk{signal,group}`, `..._quarantine_requested{group}`,
`..._pause_requested`) are exported, and the operator's rebalance timer writes them into the RLJob status
and acts on them. After a `pause` decision the process stops stepping but keeps exporting until the pod
is stopped. Every other rank (megatron, or torch's FSDP2 data parallel on one node) runs
`backend.follow()` and executes rank 0's broadcast commands (trainer/backend_common.py RankCommands).
RLFLEET_TRAINER_DEVICE (the operator sets it from the trainer's catalog class) is "cpu" on a CPU class:
either backend then runs on the CPU with a gloo process group (megatron in fp32, local layer spec).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlfleet.api.rljob import RLJob
    from rlfleet.store import Store
    from rlfleet.trainer.collapse import Decision
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.rollout import PromptGroup
    from rlfleet.trainer.run import TrainerBackend

log = logging.getLogger("rlfleet.trainer")
METRICS_PORT = 9500  # operator naming.TRAINER_METRICS_PORT


DEVICE_ENV = "RLFLEET_TRAINER_DEVICE"  # set by the operator from the trainer's catalog class


def trainer_device() -> str | None:
    """"cpu" (a CPU class: gloo, no GPU), "cuda", or None (unset: the backend's own choice)."""
    value = os.environ.get(DEVICE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("cpu", "cuda"):
        raise SystemExit(f"rlfleet trainer run: {DEVICE_ENV} must be cpu or cuda, got {value!r}")
    return value


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet trainer run", description="Trainer pod entrypoint.")
    parser.add_argument("--config", default=os.environ.get("RLFLEET_CONFIG"), help="resolved RLJob YAML")
    parser.add_argument("--router-url", default=os.environ.get("RLFLEET_ROUTER_URL"))
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT)
    parser.add_argument("--checkpoint-dir", default=None, help="default: next to the channel (<channel path>/checkpoints, or checkpoints/ under an S3 prefix)")
    args = parser.parse_args(argv)
    if not args.config:
        print("rlfleet trainer run: --config (or RLFLEET_CONFIG) is required", file=sys.stderr)
        return 2
    if not args.router_url:
        print("rlfleet trainer run: --router-url (or RLFLEET_ROUTER_URL) is required", file=sys.stderr)
        return 2
    from rlfleet.api import load_rljob
    from rlfleet.api.rljob import RLJobLoadError

    try:
        job = load_rljob(args.config)
    except RLJobLoadError as exc:
        return fail(str(exc), 2)
    logging.basicConfig(level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO"))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per rollout request otherwise
    code = run(job, args)
    # The run's end, failed or finished, ends the process at once (everything was closed by run()): a
    # thread the run left (a rollout request in flight, torch's compile workers) kept a failed run alive
    # once on the real node, and at the interpreter's shutdown a finished rank aborted in about 1 of 4 runs
    # of the CPU trainer-pod test ("terminate called without an active exception", SIGABRT: a failure the
    # operator would report as a crash loop). Flush, then exit with the run's code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


TERMINATION_LOG = Path("/dev/termination-log")  # Kubernetes' default terminationMessagePath


def fail(message: str, code: int) -> int:
    """A fatal error as one line on stderr and, in a pod, as the container's termination message (the
    kubelet creates the file; it is not created here): the operator's CrashLoopBackOff reason then
    quotes it instead of torchrun's exit summary (operator/pods.py)."""
    line = f"rlfleet trainer run: {message}"
    print(line, file=sys.stderr)
    if TERMINATION_LOG.exists():
        with contextlib.suppress(OSError):
            TERMINATION_LOG.write_text(line[:4000] + "\n")
    return code


def run(job: RLJob, args: argparse.Namespace) -> int:
    """Train the RLJob this process validated once (`cli`: `load_rljob`), resolved into the one
    training spec (trainer/config.py `resolve_run`)."""
    from rlfleet.model_source import ModelSourceError, resolve_model_source
    from rlfleet.sampler.client import SamplerClient
    from rlfleet.store import store_from_spec
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.backend_common import leave_process_group
    from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds
    from rlfleet.trainer.config import resolve_run
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.prompts import PromptFileError
    from rlfleet.trainer.publisher import WeightPublisher
    from rlfleet.trainer.rollout import RolloutDriver
    from rlfleet.trainer.run import (
        ChannelSink,
        TrainingStartError,
        build_backend,
        checkpoint_target,
        rollout_inputs,
        run_training,
    )

    rc = resolve_run(job, local=False)
    try:  # a directory on the shared volume, s3://, or a Hugging Face id (fetched into HF_HOME)
        source = resolve_model_source(job.spec.model.path, revision=job.spec.model.revision)
        base = build_backend(rc, backend=job.spec.trainer.backend, source_dir=source,
                             max_seq_len=job.spec.model.max_seq_len, parallelism=job.spec.trainer.parallelism,
                             device=trainer_device())
    except (ModelSourceError, TrainingStartError) as exc:
        return fail(str(exc), 2)
    backend = base.backend
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        backend.follow()  # execute rank 0's commands until it closes the backend
        leave_process_group()
        return 0

    store = store_from_spec(job.spec.weight_channel.store)
    # one publisher id per job, the same across pod restarts: a restarted trainer takes over its own claim
    # of a publish that was interrupted (killed, a full store) instead of failing on it (rlfleet/channel.py)
    publisher = WeightPublisher(store, views=rc.views, keep_versions=job.spec.weight_channel.retention.keep_versions,
                                base_checkpoint=base.base_checkpoint,
                                publisher_id=f"trainer/{job.metadata.namespace or 'default'}/{job.name}")  # fmt: skip
    checkpoints = checkpoint_target(store, args.checkpoint_dir)
    try:
        state = ckpt.load_latest(checkpoints)
    except ckpt.CheckpointError as exc:  # every kept checkpoint refused: one line, the pod's termination message
        return fail(f"cannot resume: {exc}", 1)
    exporter = PrometheusExporter(port=args.metrics_port, addr="0.0.0.0")  # metrics only, no control surface
    _serve_if_finished_else_resume(state, rc.steps, backend, store, exporter)
    detector = CollapseDetector(CollapseThresholds.from_safety(rc.safety), action=rc.safety.action)
    sink = ChannelSink(publisher)

    def make_driver(position: int) -> RolloutDriver:
        env, prompts = rollout_inputs(rc, base)
        return RolloutDriver(
            SamplerClient(args.router_url, vocab_size=base.vocab_size), env, prompts,
            samples_per_prompt=rc.samples_per_prompt, sampling=rc.sampling, max_seq_len=base.max_seq_len,
            start_position=position, max_ahead_prompts=2 * rc.prompts_per_step,
        )

    def on_step(metrics: dict[str, float], decision: Decision, groups: list[PromptGroup]) -> None:
        exporter.update(int(metrics["step"]), {**metrics, "weight_version": metrics["step"]})  # version = step
        exporter.update_collapse(decision.alerts, sorted(detector.quarantined), decision.pause)

    try:
        loop = run_training(rc, backend, sink, detector, make_driver, checkpoint=checkpoints, resume=state,
                            on_step=on_step)
        log.info("training finished at step %d", loop.state.step)
        if loop.state.paused:  # keep exporting the pause (and why) for the operator until the pod is stopped
            log.warning("training paused by the collapse detector; exporting metrics until stopped")
            threading.Event().wait()
    except (TrainingStartError, PromptFileError) as exc:
        return fail(str(exc), 2)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # One clear line (the pod's termination message, hence the RLJob's CrashLoopBackOff reason): the
        # checkpoint and every version's bytes are written before their pointer moves, so nothing
        # partial is named; a restart resumes from the last checkpoint once there is room.
        where = f": {exc.filename}" if exc.filename else ""
        return fail(f"the weight store {store.uri} is full ({exc.strerror}{where}); the channel "
                    f"still names v{sink.latest_version()} (complete: bytes are written before the pointer "
                    "moves). Free space on the volume or grow it: the trainer then resumes from its last "
                    "checkpoint", 1)  # fmt: skip
    finally:
        exporter.close()
        store.close()
        backend.close()
        leave_process_group()
    return 0


def _serve_if_finished_else_resume(
    state: dict[str, Any] | None,
    total_steps: int,
    backend: TrainerBackend,
    store: Store,
    exporter: PrometheusExporter,
) -> None:
    """With a checkpoint at or past the last step, serve the finished run's metrics until the pod is
    stopped (never returns); with an earlier one, say where training resumes."""
    from rlfleet.trainer.backend_common import leave_process_group

    if state is not None and int(state["step"]) >= total_steps:
        # Restarted after its last step (a StatefulSet restarts a container that exits, even with 0): do
        # not train again and do not exit into a restart loop. Release the other ranks, export the
        # finished run's final metrics and `rlfleet_trainer_finished`, and wait: the operator reads the
        # RLJob as Succeeded (docs/operations.md, "When training finishes").
        backend.close()
        leave_process_group()
        store.close()
        step = int(state["step"])
        exporter.update(step, {**(state.get("history") or [{}])[-1], "weight_version": step})
        exporter.update_finished()
        log.info("training finished at step %d (spec.trainer.totalSteps %d): exporting its final metrics until "
                 "the pod is stopped", step, total_steps)  # fmt: skip
        threading.Event().wait()
    if state is not None:  # a restarted pod: the step and data position the last publish checkpointed
        log.info("resuming from the checkpoint at step %d (data position %d)", int(state["step"]),
                 int(state["data_position"]))  # fmt: skip
