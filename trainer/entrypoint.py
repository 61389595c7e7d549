"""`rlfleet trainer run --config /etc/rlfleet/run/rljob.yaml`: the trainer pod's entrypoint (under torchrun).

Reads the resolved RLJob the operator wrote into the ConfigMap; cluster endpoints come from the env the
operator sets (RLFLEET_ROUTER_URL; the job's API key RLFLEET_API_KEY and store credentials by reference).
Global rank
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
`backend.follow()` and executes rank 0's broadcast commands (trainer/backends/backend_common.py RankCommands).
RLFLEET_TRAINER_DEVICE (the operator sets it from the trainer's catalog class) is "cpu" on a CPU class:
either backend then runs on the CPU with a gloo process group (megatron in fp32, local layer spec).
Exit codes: 0 finished, 2 the job cannot start as configured, and one code per runtime failure (a full,
unreachable or contended store, no loadable checkpoint, no rollouts: trainer/failures.py), each with one
line on stderr and in the termination message; any other error is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from rlfleet.api.rljob import RLJob
    from rlfleet.store import Store
    from rlfleet.trainer.collapse import Decision
    from rlfleet.trainer.config import RunConfig
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.publish.publisher import WeightPublisher
    from rlfleet.trainer.rollout.driver import PromptGroup, RolloutDriver
    from rlfleet.trainer.run import BaseModel, TrainerBackend

log = logging.getLogger("rlfleet.trainer")
METRICS_PORT = 9500  # operator naming.TRAINER_METRICS_PORT


DEVICE_ENV = "RLFLEET_TRAINER_DEVICE"  # set by the operator from the trainer's catalog class


def trainer_device() -> str | None:
    """ "cpu" (a CPU class: gloo, no GPU), "cuda", or None (unset: the backend's own choice)."""
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
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="default: next to the channel (<channel path>/checkpoints, or checkpoints/ under an S3 prefix)",
    )
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
    exit_now(run(job, args))


def exit_now(code: int) -> NoReturn:
    """The run's end, failed or finished, ends the process at once (everything was closed by run()): a
    thread the run left (a rollout request in flight, torch's compile workers) kept a failed run alive
    once on the real node, and at the interpreter's shutdown a finished rank aborted in about 1 of 4 runs
    of the CPU trainer-pod test ("terminate called without an active exception", SIGABRT: a failure the
    operator would report as a crash loop). Flush, then exit with the run's code."""
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
    from rlfleet.store import store_from_spec
    from rlfleet.trainer.config import resolve_run
    from rlfleet.trainer.envs.prompts import PromptFileError
    from rlfleet.trainer.failures import EXIT_BAD_INPUT, FailureContext, describe_failure
    from rlfleet.trainer.publish import checkpoint as ckpt
    from rlfleet.trainer.run import TrainingStartError, build_backend, checkpoint_target

    rc = resolve_run(job, local=False)
    try:  # a directory on the shared volume, s3://, or a Hugging Face id (fetched into HF_HOME)
        source = resolve_model_source(job.spec.model.path, revision=job.spec.model.revision)
        base = build_backend(
            rc,
            backend=job.spec.trainer.backend,
            source_dir=source,
            max_seq_len=job.spec.model.max_seq_len,
            parallelism=job.spec.trainer.parallelism,
            device=trainer_device(),
        )
    except (ModelSourceError, TrainingStartError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    backend = base.backend
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        backend.follow()  # execute rank 0's commands until it closes the backend (the stop handshake)
        return 0  # ended at once by exit_now, the process group with it (trainer/backends/backend_common.py)

    store = store_from_spec(job.spec.weight_channel.store)
    checkpoints = checkpoint_target(store, args.checkpoint_dir)
    started: dict[str, RolloutDriver] = {}
    try:
        return _train_rank0(job, args, rc, base, store, checkpoints, started)
    except (TrainingStartError, PromptFileError) as exc:
        return fail(str(exc), EXIT_BAD_INPUT)
    except Exception as exc:
        # A failure an operator can act on: one line naming the store, the path and the fix, and its own
        # exit code (trainer/failures.py); the pod's termination message, hence the RLJob's
        # CrashLoopBackOff reason. Anything else is a bug and keeps its traceback.
        driver = started.get("driver")
        described = describe_failure(
            exc,
            FailureContext(
                store=store.uri,
                checkpoints=str(checkpoints)
                if isinstance(checkpoints, Path)
                else store.uri_of(ckpt.STORE_PREFIX),
                router=args.router_url,
                rollout_logs="kubectl get samplergroups, and the logs of their pods",
                own_store="its own spec.weightChannel.store path",
                continue_with="the trainer resumes from its last checkpoint when its pod restarts",
                detail=driver.outage_note() if driver is not None else "",
            ),
        )
        if described is None:
            raise
        code, line = described
        return fail(line, code)
    finally:
        store.close()
        backend.close()
        # The process then ends at once (cli: exit_now, os._exit), finished or failed, without destroying
        # the process group: gloo's destroy hung on a rank whose peer had gone (rank 0 on the real node
        # after ENOSPC mid-publish; a follower after a finish in the trainer image, holding the GIL), which
        # kept the trainer's container Running.


def _train_rank0(
    job: RLJob,
    args: argparse.Namespace,
    rc: RunConfig,
    base: BaseModel,
    store: Store,
    checkpoints: Path | Store,
    started: dict[str, RolloutDriver],
) -> int:
    """Rank 0: take the channel, resume (or serve a finished run), train and publish. Its failures are
    described by `run`; the rollout driver it builds goes in `started` (what it knows of the router)."""
    from rlfleet.api.common import ENGINE_API_KEY_ENV
    from rlfleet.sampler.client import SamplerClient
    from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.publish import checkpoint as ckpt
    from rlfleet.trainer.rollout.driver import RolloutDriver
    from rlfleet.trainer.run import ChannelSink, rollout_inputs, rollout_sampling, run_training

    publisher = _channel_writer(job, rc, base.base_checkpoint, store)  # LeaseHeldError: another trainer
    state = ckpt.load_latest(checkpoints)  # CheckpointError: no kept checkpoint loads
    exporter = PrometheusExporter(port=args.metrics_port, addr="0.0.0.0")  # metrics only, no control surface
    try:
        _serve_if_finished_else_resume(state, rc.steps, base.backend, store, exporter)
        detector = CollapseDetector(CollapseThresholds.from_safety(rc.safety), action=rc.safety.action)

        def make_driver(position: int) -> RolloutDriver:
            env, prompts = rollout_inputs(rc, base)
            driver = started["driver"] = RolloutDriver(
                # the job's key (RLFLEET_API_KEY, from its Secret by reference): the router refuses requests without it
                SamplerClient(
                    args.router_url,
                    vocab_size=base.vocab_size,
                    api_key=os.environ.get(ENGINE_API_KEY_ENV) or None,
                    adapters=rc.lora is not None,  # the router names each replica's newest adapter
                ),
                env,
                prompts,
                samples_per_prompt=rc.samples_per_prompt,
                sampling=rollout_sampling(rc, base),
                max_seq_len=base.max_seq_len,
                start_position=position,
                max_ahead_prompts=2 * rc.prompts_per_step,
            )
            return driver

        def on_step(metrics: dict[str, float], decision: Decision, groups: list[PromptGroup]) -> None:
            exporter.update(int(metrics["step"]), metrics)  # its weight_version: step + the version offset
            exporter.update_collapse(decision.alerts, sorted(detector.quarantined), decision.pause)
            # this step's version, per view, and the bytes stored per view over every version published
            exporter.update_published(publisher.last_published.values(), publisher.stored_bytes_total)

        loop = run_training(
            rc,
            base.backend,
            ChannelSink(publisher),
            detector,
            make_driver,
            checkpoint=checkpoints,
            resume=state,
            on_step=on_step,
        )
        log.info("training finished at step %d", loop.state.step)
        if loop.state.paused:  # keep exporting the pause (and why) for the operator until the pod is stopped
            log.warning("training paused by the collapse detector; exporting metrics until stopped")
            threading.Event().wait()
    finally:
        exporter.close()
    return 0


def _channel_writer(job: RLJob, rc: RunConfig, base_checkpoint: Path | None, store: Store) -> WeightPublisher:
    """The job's publisher (publisher.channel_writer): one id per job, the same across pod restarts (a
    restarted trainer takes over its own claim of a publish that was interrupted, killed or on a full
    store: rlfleet/channel.py), the RLJob's views, retention and deltas."""
    from rlfleet.trainer.publish.publisher import channel_writer

    wc = job.spec.weight_channel
    return channel_writer(
        store,
        rc.views,
        publisher_id=f"trainer/{job.metadata.namespace or 'default'}/{job.name}",
        keep_versions=wc.retention.keep_versions,
        deltas=wc.deltas,
        base_checkpoint=base_checkpoint,
        lora=rc.adapter_config(),  # LoRA: each version the adapter, each base view stored once
    )


def _serve_if_finished_else_resume(
    state: dict[str, Any] | None,
    total_steps: int,
    backend: TrainerBackend,
    store: Store,
    exporter: PrometheusExporter,
) -> None:
    """With a checkpoint at or past the last step, serve the finished run's metrics until the pod is
    stopped (never returns); with an earlier one, say where training resumes."""
    if state is not None and int(state["step"]) >= total_steps:
        # Restarted after its last step (a StatefulSet restarts a container that exits, even with 0): do
        # not train again and do not exit into a restart loop. Release the other ranks, export the
        # finished run's final metrics and `rlfleet_trainer_finished`, and wait: the operator reads the
        # RLJob as Succeeded (docs/operations.md, "When training finishes").
        backend.close()  # the followers confirm the stop and end; this rank keeps its group, idle
        store.close()
        step = int(state["step"])
        exporter.update(
            step,
            {
                **(state.get("history") or [{}])[-1],
                "weight_version": step + int(state.get("version_offset", 0)),
            },
        )
        exporter.update_finished()
        log.info(
            "training finished at step %d (spec.trainer.totalSteps %d): exporting its final metrics until "
            "the pod is stopped",
            step,
            total_steps,
        )
        threading.Event().wait()
    if state is not None:  # a restarted pod: the step and data position the last publish checkpointed
        log.info(
            "resuming from the checkpoint at step %d (data position %d)",
            int(state["step"]),
            int(state["data_position"]),
        )
