"""`rlfleet trainer run --config /etc/rlfleet/run/rljob.yaml`: the trainer pod's entrypoint (under torchrun).

Reads the resolved RLJob the operator wrote into the ConfigMap; cluster endpoints come from the env the
operator sets (RLFLEET_ROUTER_URL, RLFLEET_TRAINER_BACKEND, store credentials by reference). Global rank
0 drives everything: rollouts through the router, the loop, publishing to the weight channel, the
Prometheus exporter (`rlfleet_trainer_*`, scope=group/view/staleness: the rebalancer reads the
per-group KL/OOR from it), checkpoints on the channel's volume. The trainer has NO Kubernetes API rights
(its pods do not mount a ServiceAccount token): step, published weight version, fleet metrics and the
collapse detector's state (`rlfleet_trainer_collapse_risk{signal,group}`, `..._quarantine_requested{group}`,
`..._pause_requested`) are exported, and the operator's rebalance timer writes them into the RLJob status
and acts on them. After a `pause` decision the process stops stepping but keeps exporting until the pod
is stopped. With the megatron backend every other rank runs `backend.follow()` and executes rank 0's
broadcast commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("rlfleet.trainer")
METRICS_PORT = 9500  # operator naming.TRAINER_METRICS_PORT


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlfleet trainer run", description="Trainer pod entrypoint.")
    parser.add_argument("--config", default=os.environ.get("RLFLEET_CONFIG"), help="resolved RLJob YAML")
    parser.add_argument("--router-url", default=os.environ.get("RLFLEET_ROUTER_URL"))
    parser.add_argument("--metrics-port", type=int, default=METRICS_PORT)
    parser.add_argument("--checkpoint-dir", default=None, help="default: <channel path>/checkpoints")
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
        print(f"rlfleet trainer run: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("RLFLEET_LOG_LEVEL", "INFO"))
    return run(job, args)


def _build_backend(job: Any, rc: Any) -> Any:
    from rlfleet.trainer.backend_torch import OptimConfig
    from rlfleet.trainer.objective import ObjectiveConfig

    objective = ObjectiveConfig.from_correction(rc.correction_mode, mis_low=rc.mis_low, mis_high=rc.mis_high)
    optim = OptimConfig(learning_rate=rc.learning_rate, weight_decay=rc.weight_decay, max_grad_norm=rc.max_grad_norm)
    from rlfleet.numerics.views import load_view

    _, hf = load_view(job.spec.model.path)  # the initial weights: a view directory with HF names
    if job.spec.trainer.backend == "torch":
        from rlfleet.numerics.tinygpt import config_from_state_dict
        from rlfleet.trainer.backend_torch import TorchBackend

        n_head = int(os.environ.get("RLFLEET_N_HEAD", "4"))
        cfg = config_from_state_dict(hf, n_head, job.spec.model.max_seq_len or 2048, rc.seed)
        backend = TorchBackend(cfg, objective, optim, temperature=rc.sampling["temperature"])
        backend.model.load_state_dict(hf)
        return backend, cfg.vocab_size, cfg.max_seq_len
    from rlfleet.trainer.backend_megatron import MegatronBackend, MegatronModelConfig

    p = job.spec.trainer.parallelism
    import json

    hf_cfg = json.loads((Path(job.spec.model.path) / "config.json").read_text())
    cfg = MegatronModelConfig.from_hf_config(  # head_dim, tied embeddings, QK-norm, either rope form
        hf_cfg, max_seq_len=job.spec.model.max_seq_len, tensor_parallel=p.tensor, pipeline_parallel=p.pipeline,
        context_parallel=p.context,
    )
    return MegatronBackend(cfg, objective, optim, rc.sampling["temperature"], initial_hf_weights=hf), cfg.vocab_size, cfg.max_seq_len


def run(job: Any, args: argparse.Namespace) -> int:
    from rlfleet.sampler.client import SamplerClient
    from rlfleet.store import store_from_spec
    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.collapse import CollapseDetector, CollapseThresholds
    from rlfleet.trainer.local import build_environment, resolve_run
    from rlfleet.trainer.loop import LoopConfig, TrainingLoop
    from rlfleet.trainer.metrics import PrometheusExporter
    from rlfleet.trainer.prompts import open_prompt_source
    from rlfleet.trainer.publisher import WeightPublisher
    from rlfleet.trainer.rollout import RolloutDriver

    rc = resolve_run(job, local=False)
    backend, vocab, max_seq_len = _build_backend(job, rc)
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        backend.follow()  # megatron: execute rank 0's commands until it stops
        return 0

    store = store_from_spec(job.spec.weight_channel.store)
    views = sorted({g["weight_format"] for g in rc.groups})
    publisher = WeightPublisher(store, views=views, keep_versions=job.spec.weight_channel.retention.keep_versions)
    ckpt_dir = Path(args.checkpoint_dir or Path(job.spec.weight_channel.store.path or "/tmp") / "checkpoints")
    state = ckpt.load_latest(ckpt_dir)
    exporter = PrometheusExporter(port=args.metrics_port, addr="0.0.0.0")  # metrics only, no control surface
    detector = CollapseDetector(CollapseThresholds.from_safety(rc.safety), action=rc.safety.action)
    driver = RolloutDriver(
        SamplerClient(args.router_url, vocab_size=vocab), build_environment(rc),
        open_prompt_source(rc.dataset, rc.environment, seed=rc.seed, vocab_size=vocab),
        samples_per_prompt=rc.samples_per_prompt, sampling=rc.sampling, max_seq_len=max_seq_len,
        start_position=int(state["data_position"]) if state else 0, max_ahead_prompts=2 * rc.prompts_per_step,
    )
    loop_ref: dict[str, Any] = {}
    published = {"version": latest.version if (latest := publisher.channel.latest()) is not None else None}

    def publish(version: int, weights: dict) -> None:
        loop_ref["loop"].checkpoint()  # before the pointer moves: the channel is never ahead of a checkpoint
        publisher.publish(weights, version=version)
        published["version"] = version

    def on_step(metrics: dict[str, float], decision: Any) -> None:
        version = {} if published["version"] is None else {"weight_version": float(published["version"])}
        exporter.update(int(metrics["step"]), {**metrics, **version})
        exporter.update_collapse(decision.alerts, sorted(detector.quarantined), decision.pause)

    loop = TrainingLoop(
        LoopConfig(total_steps=rc.steps, prompts_per_step=rc.prompts_per_step, max_staleness=rc.max_staleness,
                   checkpoint_dir=ckpt_dir),
        backend, driver, publish, detector,
        group_names=[g["name"] for g in rc.groups], group_views={g["name"]: g["weight_format"] for g in rc.groups},
        on_step=on_step, stop=threading.Event(),
    )
    loop_ref["loop"] = loop
    if state is not None:
        loop.restore(state)
    latest = publisher.channel.latest()
    if latest is None or latest.version < loop.state.step:
        publisher.publish(backend.weights(), version=loop.state.step)
        published["version"] = loop.state.step
    driver.start()
    try:
        loop.run()
        loop.checkpoint()
    finally:
        driver.stop()
    try:
        if loop.state.paused:  # keep exporting the pause (and why) for the operator until the pod is stopped
            log.warning("training paused by the collapse detector; exporting metrics until stopped")
            threading.Event().wait()
    finally:
        exporter.close()
        if hasattr(backend, "close"):
            backend.close()
    return 0
