"""The ONE training composition root: local mode (rlfleet/local/main.py), the cluster entrypoint
(trainer/entrypoint.py, `rlfleet trainer run`) and the ablation (experiments/ablation.py) all train through
`run_training`. What differs between them is passed in: the backend (built by `build_backend` from the
resolved model source), where versions go (`VersionSink`: the weight channel, or the ablation's
in-memory snapshots), how rollouts are produced (`make_driver`: the HTTP rollout driver, or the
ablation's lockstep in-process samplers) and the per-step hooks (live table, Prometheus exporter).

Order (docs/architecture.md, "Trainer"):
1. restore the checkpoint if there is one (model, optimizer, step, detector; the data position);
2. publish the current weights as version `step` (+ the checkpoint's version offset) unless the channel
   already holds it: on a fresh start this is version 0 of EVERY view, from the base checkpoint, before
   step 1 (sampler groups wait for their view's version 0 before their engine starts, sampler/sync.py
   --fetch-only). A checkpoint older than the channel's pointer (the newer ones were damaged and
   refused) resumes too: its weights are published as pointer + 1, and version = step + offset from then
   on (`resume_version`);
3. only then build and start the rollout driver (samplers can serve now), and run the loop: each
   version N is published after a checkpoint (the channel is never ahead of a checkpoint);
4. a final checkpoint; the driver is stopped in every case.

Every step's metrics (the dict the `on_step` hook gets) also go to the experiment tracker
(trainer/tracking.py, RLFLEET_TRACKING; nothing when unset), opened once and closed in every case.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlfleet.api.rljob import ROUTING_REPLAY_MEGATRON_MESSAGE
from rlfleet.hf_config import is_moe_config
from rlfleet.model_source import is_hf_checkpoint
from rlfleet.store import Store
from rlfleet.trainer.collapse import CollapseDetector, Decision
from rlfleet.trainer.config import RunConfig, build_environment
from rlfleet.trainer.loop import Backend, LoopConfig, RolloutSource, TrainingLoop
from rlfleet.trainer.publish.checkpoint import WriterFence
from rlfleet.trainer.rollout.driver import PromptGroup
from rlfleet.trainer.tracking import Tracker, TrackingError, open_tracker

if TYPE_CHECKING:
    from rlfleet.api.rljob import ParallelismSpec
    from rlfleet.sampler.protocol import SamplingConfig
    from rlfleet.trainer.backends.backend_megatron import MegatronModelConfig
    from rlfleet.trainer.envs.environments import Environment
    from rlfleet.trainer.envs.prompts import PromptSource
    from rlfleet.trainer.publish.publisher import WeightPublisher

log = logging.getLogger(__name__)


class TrainingStartError(RuntimeError):
    """The run cannot start as configured (one-line message, no stack trace for users)."""


class VersionSink(Protocol):
    """Where weight versions go: `publish(weights, version, step=...)` (the trainer step whose weights
    they are), `latest_version()` (None: none yet), `fence()`: the writer lease checkpoints are fenced
    with (None: no lease)."""

    def latest_version(self) -> int | None: ...

    def publish(self, weights: dict[str, torch.Tensor], version: int, *, step: int) -> None: ...

    def fence(self) -> WriterFence | None: ...


class ChannelSink:
    """The weight channel as a VersionSink, through trainer/publish/publisher.py's `WeightPublisher` (which
    calibrates nvfp4's activation amax on the published weights themselves, whatever the backend)."""

    def __init__(self, publisher: WeightPublisher) -> None:
        self.publisher = publisher

    def latest_version(self) -> int | None:
        pointer = self.publisher.channel.latest()
        return None if pointer is None else pointer.version

    def publish(self, weights: dict[str, torch.Tensor], version: int, *, step: int) -> None:
        self.publisher.publish(
            weights, version=version, metadata={"step": step}
        )  # version != step after a fallback

    def fence(self) -> WriterFence | None:
        """The publisher's writer lease, checked (and renewed) before each checkpoint is written."""
        lease = self.publisher.channel.lease
        return None if lease is None else WriterFence(lease.generation, self.publisher.check_lease)


class TrainerBackend(Backend, Protocol):
    """A backend as the cluster entrypoint drives it: the loop's `Backend`, and rank 0 commanding the
    other ranks (trainer/backends/backend_common.py `RankCommands`: `follow` on the others, `close` on rank 0)."""

    def follow(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class BaseModel:
    """The trainer's model, built from the resolved model source."""

    backend: TrainerBackend  # HFBackend (transformers) or MegatronBackend
    vocab_size: int
    max_seq_len: int
    source_dir: Path  # the resolved Hugging Face checkpoint directory

    @property
    def base_checkpoint(self) -> Path | None:
        """The HF checkpoint every published view is completed from (config, tokenizer); None: tensor-only."""
        return self.source_dir if is_hf_checkpoint(self.source_dir) else None

    @property
    def routed_experts_top_k(self) -> int:
        """The experts each token uses when the checkpoint is a mixture of experts (its config's
        `num_experts_per_tok`: what a rollout asks its samplers to return, `SamplingConfig.routed_experts_top_k`,
        so that the trainer measures the routing mismatch, trainer/backends/routing.py); 0 for a dense model."""
        if not is_hf_checkpoint(self.source_dir):
            return 0
        config = json.loads((self.source_dir / "config.json").read_text())
        return int(config["num_experts_per_tok"]) if is_moe_config(config) else 0


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(base: BaseModel) -> Any | None:
    """The base HF checkpoint's tokenizer (AutoTokenizer) for text prompt sets and chat environments;
    None for a checkpoint without tokenizer files:
    prompts are then token ids, as without a tokenizer (trainer/envs/prompts.py)."""
    directory = base.base_checkpoint
    if directory is None or not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def rollout_inputs(rc: RunConfig, base: BaseModel) -> tuple[Environment, PromptSource]:
    """The run's environment and prompt source (local mode and the cluster entrypoint alike), both
    given the base checkpoint's tokenizer where it has one (text prompt sets, chat environments)."""
    from rlfleet.trainer.envs.prompts import open_prompt_source

    tokenizer = load_tokenizer(base)
    prompts = open_prompt_source(
        rc.dataset, rc.environment, seed=rc.seed, vocab_size=base.vocab_size, tokenizer=tokenizer
    )
    return build_environment(rc, tokenizer=tokenizer), prompts


def rollout_sampling(rc: RunConfig, base: BaseModel) -> SamplingConfig:
    """The sampling parameters of every turn (local mode and the cluster entrypoint alike): the job's,
    and for a mixture of experts each turn asks for the experts its tokens were routed to
    (`routed_experts_top_k`), which the trainer compares with its own routing (trainer/backends/routing.py) and
    routing replay uses. Samplers return them: the reference engine always, SGLang groups because their
    launch adds `--enable-return-routed-experts` for such a checkpoint (docs/sampler.md)."""
    return replace(rc.sampling, routed_experts_top_k=base.routed_experts_top_k)


def load_base_weights(directory: Path) -> dict[str, torch.Tensor]:
    """HF-named tensors of a checkpoint directory: an rlfleet view (dequantized) or HF safetensors."""
    from rlfleet.model_source import ModelSourceError
    from rlfleet.numerics.views import load_checkpoint_weights

    try:
        return load_checkpoint_weights(directory)[1]
    except ModelSourceError as exc:
        raise TrainingStartError(str(exc)) from None


def build_backend(
    rc: RunConfig,
    *,
    backend: str,
    source_dir: Path,
    max_seq_len: int | None = None,
    parallelism: ParallelismSpec | None = None,
    device: str | None = None,
) -> BaseModel:
    """The backend for `rc` from the Hugging Face checkpoint `source_dir` (local
    mode: the tiny Qwen3 it built; a cluster: the resolved `spec.model.path`): `torch` = transformers'
    AutoModelForCausalLM (trainer/backends/backend_hf.py), `megatron` = megatron-core from config.json
    (`MegatronModelConfig.from_hf_config`). `device`: "cuda" or "cpu" (a trainer on a CPU class: gloo;
    megatron in fp32 with the local layer spec, as the torch backend trains fp32 on CPU); None: the
    torch backend picks CUDA when there is one, megatron needs CUDA."""
    objective, optim, temperature = rc.objective, rc.optim, rc.sampling.temperature
    if not is_hf_checkpoint(source_dir):
        raise TrainingStartError(
            f"model {source_dir}: not a Hugging Face checkpoint (no config.json); spec.model.path names a "
            "checkpoint directory, an s3:// prefix or a Hugging Face id"
        )
    hf_config = json.loads((source_dir / "config.json").read_text())
    seq = int(max_seq_len or hf_config.get("max_position_embeddings") or 2048)
    if backend == "torch":
        from rlfleet.trainer.backends.backend_hf import HFBackend

        model = HFBackend.from_pretrained(
            source_dir,
            objective,
            optim=optim,
            temperature=temperature,
            device=device,
            max_tokens_per_micro_batch=rc.max_tokens_per_micro_batch,
            activation_checkpointing=rc.activation_checkpointing,
            routing_replay=rc.routing_replay,
            lora=rc.lora,
        )
        return BaseModel(model, int(hf_config["vocab_size"]), seq, source_dir)
    if rc.routing_replay:  # the API refuses it too (rlfleet/api/rljob.py ROUTING_REPLAY_MEGATRON_MESSAGE)
        raise TrainingStartError(ROUTING_REPLAY_MEGATRON_MESSAGE)
    if rc.lora is not None:  # the API refuses it too (rlfleet/api/lora_spec.py)
        from rlfleet.api.lora_spec import LORA_BACKEND_MESSAGE

        raise TrainingStartError(LORA_BACKEND_MESSAGE)
    from rlfleet.trainer.backends.backend_megatron import MegatronBackend

    cfg = megatron_model_config(
        rc, hf_config, max_seq_len=max_seq_len, parallelism=parallelism, device=device
    )
    megatron = MegatronBackend(
        cfg, objective, optim, temperature, initial_hf_weights=load_base_weights(source_dir)
    )
    return BaseModel(megatron, cfg.vocab_size, cfg.max_seq_len, source_dir)


def megatron_model_config(
    rc: RunConfig,
    hf_config: dict[str, Any],
    *,
    max_seq_len: int | None = None,
    parallelism: ParallelismSpec | None = None,
    device: str | None = None,
) -> MegatronModelConfig:
    """The megatron backend's model config: the checkpoint's config.json (head_dim, tied embeddings,
    QK-norm, either rope form, a mixture of experts), the RLJob's parallelism (expert parallelism
    included), micro-batch budget and activation
    checkpointing (megatron's full, uniform recompute); `device` "cpu": fp32 on CPU."""
    from rlfleet.api.rljob import ParallelismSpec
    from rlfleet.trainer.backends.backend_megatron import MegatronModelConfig

    p = parallelism or ParallelismSpec()
    return MegatronModelConfig.from_hf_config(
        hf_config,
        max_seq_len=max_seq_len,
        tensor_parallel=p.tensor,
        pipeline_parallel=p.pipeline,
        context_parallel=p.context,
        expert_parallel=p.expert,
        expert_tensor_parallel=p.expert_tensor,
        max_tokens_per_micro_batch=rc.max_tokens_per_micro_batch,
        activation_checkpointing=rc.activation_checkpointing,
        **({"device": "cpu", "params_dtype": "float32"} if device == "cpu" else {}),
    )


def checkpoint_target(store: Store, override: str | Path | None = None) -> Path | Store:
    """Checkpoints go next to the channel: `<channel dir>/checkpoints` on a filesystem store, the
    `checkpoints/` keys under the channel's prefix on an S3 store (trainer/publish/checkpoint.py)."""
    if override is not None:
        return Path(override)
    from rlfleet.store import FilesystemStore

    if isinstance(store, FilesystemStore):
        return Path(store.root) / "checkpoints"
    return store


def resume_version(resume: dict[str, Any] | None, latest: int | None) -> int:
    """The weight version the trainer holds when it starts: `step` + the checkpoint's version offset, or,
    when the channel's pointer is ahead of that (the newest checkpoints were damaged and an older one
    loaded), pointer + 1: the trainer publishes above the pointer and keeps version = step + offset, so a
    version is never published twice and staleness stays measured in versions. The channel ahead of a
    run with no checkpoint at all is refused (another run's channel, or its checkpoints were removed)."""
    if resume is None:
        if latest is not None and latest > 0:
            raise TrainingStartError(
                f"the weight channel is at version {latest}, ahead of the trainer (no checkpoint): use a fresh "
                "channel or restore its checkpoints"
            )
        return 0
    step = int(resume["step"])
    version = step + int(resume.get("version_offset", 0))
    if latest is None or latest <= version:
        return version
    log.warning(
        "the weight channel is at version %d, ahead of the checkpoint of step %d (version %d; the newer "
        "checkpoints were refused): resuming from step %d and publishing its weights as version %d "
        "(version = step + %d from now on)",
        latest,
        step,
        version,
        step,
        latest + 1,
        latest + 1 - step,
    )
    return latest + 1


def run_training(
    rc: RunConfig,
    backend: Backend,
    sink: VersionSink,
    detector: CollapseDetector,
    make_driver: Callable[[int], RolloutSource],
    *,
    checkpoint: Path | Store | None,
    resume: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
    on_step: Callable[[dict[str, float], Decision, list[PromptGroup]], None] | None = None,
    on_quarantine: Callable[[list[str]], None] | None = None,
    tracker: Tracker | None = None,
) -> TrainingLoop:
    """Train `rc.steps` steps (see the module docstring for the order). `make_driver(position)` builds
    the rollout source (the HTTP driver, or the ablation's lockstep samplers) starting at data position `position` (called after the first publish);
    `resume`: a checkpoint state (trainer/publish/checkpoint.py); `tracker`: where each step's metrics go
    besides `on_step` (default: `open_tracker()`, from RLFLEET_TRACKING), closed when training ends.
    Returns the loop (state, history)."""
    start_step = int(resume["step"]) if resume is not None else 0
    latest = sink.latest_version()
    version = resume_version(resume, latest)
    if tracker is None:
        try:
            tracker = open_tracker()
        except TrackingError as exc:  # misconfigured or missing package: a clear error before anything runs
            raise TrainingStartError(str(exc)) from None
    tracker_open: Tracker = tracker

    def step_done(metrics: dict[str, float], decision: Decision, groups: list[PromptGroup]) -> None:
        if on_step is not None:
            on_step(metrics, decision, groups)  # first: local mode adds its per-group rollout figures
        tracker_open.log(int(metrics["step"]), metrics)

    def publish(version: int, weights: dict[str, torch.Tensor]) -> None:
        loop.checkpoint()  # BEFORE the pointer moves: the channel is never ahead of a checkpoint
        sink.publish(weights, version, step=loop.state.step)

    loop = TrainingLoop(
        LoopConfig(
            total_steps=rc.steps,
            prompts_per_step=rc.prompts_per_step,
            max_staleness=rc.max_staleness,
            checkpoint_dir=checkpoint,
            checkpoint_fence=sink.fence(),
        ),
        backend,
        None,
        publish,
        detector,  # the rollout source comes after version `step` is published
        group_names=[g.name for g in rc.groups],
        group_views={g.name: g.weight_format for g in rc.groups},
        on_step=step_done,
        on_quarantine=on_quarantine,
        stop=stop,
    )
    try:  # the tracker is closed in every case from here on
        if resume is not None:
            loop.restore(resume)
        loop.state.version_offset = version - start_step
        if latest is None or latest < version:  # fresh start: version 0 of every view before step 1
            sink.publish(backend.weights(), version, step=start_step)
            log.info("published the trainer's weights as version %d before step %d", version, start_step + 1)
        driver = make_driver(int(resume["data_position"]) if resume is not None else 0)
        loop.driver = driver
        driver.start()
        try:
            loop.run()
            loop.checkpoint()
        finally:
            driver.stop()
    finally:
        tracker_open.close()
    return loop
