"""RLJob -> `RunConfig`: the one typed training spec the composition root (trainer/run.py `run_training`)
takes. The cluster trainer (`rlfleet trainer run`) and local mode (`local=True` swaps in the manifest's
`local` block) resolve it from the RLJob their process validated once (`rlfleet.api.load_rljob`); the
ablation (experiments/ablation.py) builds the same dataclass from its own configuration."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rlfleet.api.common import views_to_publish
from rlfleet.api.lora_spec import LoraSpec
from rlfleet.api.rljob import (
    MAX_TOKENS_PER_MICRO_BATCH,
    ROUTING_REPLAY_LOCAL_DENSE_MESSAGE,
    SafetySpec,
    SandboxSpec,
)
from rlfleet.api.weightchannel import DeltaSpec
from rlfleet.records import HEAD_MODE, SUPPORT_MODE
from rlfleet.sampler.protocol import SamplingConfig
from rlfleet.tiny_qwen3 import TinyQwen3
from rlfleet.trainer.backends.backend_common import OptimConfig
from rlfleet.trainer.objective import ObjectiveConfig

if TYPE_CHECKING:
    from rlfleet.api.rljob import RLJob
    from rlfleet.trainer.envs.environments import Environment


@dataclass(frozen=True)
class GroupSpec:
    """A sampler group the trainer trains on (one with replicas > 0): its name, hardware and view."""

    name: str
    accelerator: str
    weight_format: str  # bf16 | fp8 | nvfp4 | mxfp4: the view the channel publishes for it
    kv_cache_dtype: str = "auto"
    quarantined: bool = False
    tensor_parallel: int | None = None  # GPUs per replica (None: the catalog's default for the class)


@dataclass
class RunConfig:
    """Everything the training loop needs (local, cluster or the ablation)."""

    job_name: str
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    sampling: SamplingConfig  # the one sampling object every turn's request is derived from
    objective: ObjectiveConfig
    optim: OptimConfig
    max_staleness: int | None
    environment: str
    max_turns: int
    dataset: str | None
    seed: int
    model: TinyQwen3 | None  # local mode and the ablation: the tiny Qwen3 they build; a cluster: None
    views: list[str]  # the views published for every version (rlfleet.api.common.views_to_publish)
    groups: list[GroupSpec] = field(default_factory=list)
    safety: SafetySpec = field(default_factory=SafetySpec)
    max_tokens_per_micro_batch: int = MAX_TOKENS_PER_MICRO_BATCH  # RLJob trainer.maxTokensPerMicroBatch
    activation_checkpointing: bool = False  # RLJob trainer.activationCheckpointing
    # the reference fleet of the cost figures: RLJob router.reference.accelerator, else trainer.accelerator
    reference_accelerator: str = "b200"
    routing_replay: bool = False  # RLJob correction.routingReplay (trainer/backends/routing_replay.py)
    sandbox: SandboxSpec = field(
        default_factory=SandboxSpec
    )  # RLJob rollout.sandbox (local mode: always local)
    keep_versions: int = 3  # RLJob weightChannel.retention.keepVersions (the versions retention keeps)
    deltas: DeltaSpec = field(
        default_factory=DeltaSpec
    )  # RLJob weightChannel.deltas (anchors every K, max delta share)
    lora: LoraSpec | None = None  # RLJob trainer.lora (docs/weights.md "LoRA"); None: full weights

    def adapter_config(self) -> dict[str, Any] | None:
        """The adapter_config.json every LoRA version is published with (rlfleet.lora.adapter_config:
        what the backend's PEFT model trains); None: full fine-tuning."""
        if self.lora is None:
            return None
        from rlfleet.lora import adapter_config

        return adapter_config(
            rank=self.lora.rank,
            alpha=self.lora.alpha,
            dropout=self.lora.dropout,
            target_modules=self.lora.target_modules,
            base_model=self.job_name,
        )

    def as_json(self) -> dict[str, Any]:
        """Plain JSON values (local mode's run.json)."""
        return asdict(self) | {
            "safety": self.safety.model_dump(mode="json", by_alias=True),
            "sandbox": self.sandbox.model_dump(mode="json", by_alias=True),
            "deltas": self.deltas.model_dump(mode="json", by_alias=True),
            "lora": None if self.lora is None else self.lora.model_dump(mode="json", by_alias=True),
        }


def resolve_run(job: RLJob, local: bool = True) -> RunConfig:
    """RLJob -> RunConfig. `local` swaps in the `local` block (sizes, tiny model, seed, LR)."""
    spec = job.spec
    lo = spec.local
    objective = ObjectiveConfig.from_correction(
        spec.correction.mode, mis_low=spec.correction.mis_low, mis_high=spec.correction.mis_high
    )
    head = (
        spec.correction.sc_head_size if not local else min(spec.correction.sc_head_size, lo.model.vocab_size)
    )
    sampling = SamplingConfig(
        temperature=spec.rollout.temperature,
        top_p=spec.rollout.top_p,
        top_k=spec.rollout.top_k,
        max_new_tokens=lo.max_new_tokens if local else spec.rollout.max_new_tokens,
        # replay needs the exact sampling support; the other modes score against the full-vocabulary q
        # and, for score centering, its top-K head
        candidate_mode=SUPPORT_MODE if objective.replay else HEAD_MODE,
        head_size=head,
    )
    if local and spec.correction.routing_replay and lo.model.architecture != "qwen3_moe":
        # the API cannot refuse it: a cluster job ignores `local` (rlfleet/api/rljob.py)
        raise ValueError(ROUTING_REPLAY_LOCAL_DENSE_MESSAGE)
    opt = spec.trainer.optimizer
    return RunConfig(
        job_name=job.name,
        steps=lo.steps if local else (spec.trainer.total_steps or 10**12),
        prompts_per_step=lo.prompts_per_step if local else spec.rollout.prompts_per_step,
        samples_per_prompt=lo.samples_per_prompt if local else spec.rollout.samples_per_prompt,
        sampling=sampling,
        objective=objective,
        optim=OptimConfig(
            learning_rate=float(lo.learning_rate)
            if local
            else opt.learning_rate,  # local: sized for the tiny model
            weight_decay=opt.weight_decay,
            max_grad_norm=opt.max_grad_norm,
        ),
        max_staleness=spec.staleness.max_steps,
        environment=spec.rollout.environment,
        max_turns=spec.rollout.max_turns,
        dataset=spec.rollout.dataset,
        seed=lo.seed,
        model=TinyQwen3(**lo.model.model_dump(), seed=lo.seed) if local else None,
        views=views_to_publish(g.weight_format for g in spec.sampler_groups),  # 0-replica groups too
        groups=[
            GroupSpec(
                g.name, g.accelerator, g.weight_format, g.kv_cache_dtype, g.quarantined, g.tensor_parallel
            )
            for g in spec.sampler_groups
            if g.replicas > 0
        ],
        safety=spec.safety,
        max_tokens_per_micro_batch=spec.trainer.max_tokens_per_micro_batch,
        activation_checkpointing=spec.trainer.activation_checkpointing,
        reference_accelerator=spec.router.reference.accelerator or spec.trainer.accelerator,
        routing_replay=spec.correction.routing_replay,
        sandbox=SandboxSpec() if local else spec.rollout.sandbox,  # local mode has no cluster to make pods in
        keep_versions=spec.weight_channel.retention.keep_versions,
        deltas=spec.weight_channel.deltas,
        lora=spec.trainer.lora,  # local mode too: the tiny model trains the same adapter
    )


def build_environment(rc: RunConfig, tokenizer: Any = None) -> Environment:
    """`tokenizer`: the model's (trainer/run.py `load_tokenizer`), for environments that take one."""
    from rlfleet.trainer.envs.environments import load_environment

    env = copy.copy(
        load_environment(rc.environment, tokenizer=tokenizer)
    )  # never mutate a shared built-in instance
    if env.max_turns != 1:
        env.max_turns = rc.max_turns
    if rc.sandbox.backend != "local":
        if not hasattr(env, "sandbox"):
            raise ValueError(
                f"rollout.sandbox.backend {rc.sandbox.backend}: environment {rc.environment!r} runs no "
                "sandboxes (it has no `sandbox` factory, as rlfleet.trainer.envs.swe_env:SweEnv has)"
            )
        if rc.sandbox.backend == "pods":
            from rlfleet.sandbox.pods import PodSandboxes

            # made before the first episode: it deletes the sandbox pods a previous run of this trainer pod left
            env.sandbox = PodSandboxes.from_environment(rc.sandbox, rc.job_name)
        else:
            from rlfleet.sandbox.agent_sandbox import AgentSandboxes

            # made before the first episode: it makes (or checks) the job's SandboxWarmPool of the template
            env.sandbox = AgentSandboxes.from_environment(rc.sandbox, rc.job_name)
    return env
