"""RLJob: one asynchronous RL run (trainer + heterogeneous sampler fleet + router + weight channel). Its
router part is in router_spec.py, its status in rljob_status.py."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationError, model_validator

from rlfleet.api.common import (
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    MAX_JOB_NAME,
    MAX_TOP_K,
    ApiModel,
    CorrectionMode,
    SafetyAction,
    cel_list,
    cel_rules,
    kube_manifest_check,
)
from rlfleet.api.external_trainer import (
    EXTERNAL_LORA_MESSAGE,
    EXTERNAL_LORA_RULE,
    EXTERNAL_MOUNT_MESSAGE,
    EXTERNAL_MOUNT_RULE,
    ExternalTrainerSpec,
)
from rlfleet.api.lora_spec import LORA_BACKEND_MESSAGE, LORA_BACKEND_RULE, LoraSpec
from rlfleet.api.meta import KubeObject
from rlfleet.api.podfields import POD_FIELDS_RULES, Quantity
from rlfleet.api.rljob_status import RLJobStatus
from rlfleet.api.router_spec import (
    FLEET_GROUPS_MESSAGE,
    FLEET_GROUPS_RULE,
    STATIC_SHARES_GROUPS_MESSAGE,
    STATIC_SHARES_GROUPS_RULE,
    RouterSpec,
)
from rlfleet.api.samplergroup import SamplerGroupTemplate, SamplerImages
from rlfleet.api.scheduling import PodPlacement
from rlfleet.api.weightchannel import DeltaSpec, RetentionSpec, StoreSpec
from rlfleet.yamlfile import read_yaml

# Cross-field rules: the CEL rule in the CRD and the Python check share the message, so a user sees
# the same words from `kubectl apply` and from `rlfleet run --local`.
TOP_P_RULE = f"self.topP >= 1.0 || (self.topK >= 1 && self.topK <= {MAX_TOP_K})"
TOP_P_MESSAGE = (
    f"rollout: topP < 1 requires a finite topK in [1, {MAX_TOP_K}] "
    "(SGLang returns the sampling mask only with a finite top_k)"
)
MIS_RULE = "self.misLow < self.misHigh"
MIS_MESSAGE = "correction: misLow must be < misHigh"
GROUP_NAMES_RULE = "self.all(g, self.exists_one(h, h.name == g.name))"
GROUP_NAMES_MESSAGE = "samplerGroups: group names must be unique"
JOB_NAME_RULE = f"size(self.metadata.name) <= {MAX_JOB_NAME}"
JOB_NAME_MESSAGE = f"metadata.name must be at most {MAX_JOB_NAME} characters (child names are <job>-<group>)"
JOB_NAME_DNS_RULE = f"self.metadata.name.matches('{DNS_LABEL_PATTERN}')"
JOB_NAME_DNS_MESSAGE = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter; no "
    "dots): it prefixes the names of the job's Services <job>-trainer, <job>-router and <job>-<group>"
)
PIPELINE_RULE = "self.pipeline == 1"
PIPELINE_MESSAGE = (
    "trainer.parallelism: pipeline parallelism is not supported yet (the megatron backend loads and "
    "publishes weights only with pipeline 1)"
)
GPU_RANKS_DEFAULT = 8  # gpusPerReplica when unset on a GPU class
CPU_RANKS_DEFAULT = 1  # processesPerReplica when unset on a CPU class


def ranks_expr(cpu_classes: tuple[str, ...] | list[str]) -> str:
    """CEL: torchrun ranks per trainer pod (gpusPerReplica, processesPerReplica, or the class's default)."""
    return (
        "(has(self.gpusPerReplica) ? self.gpusPerReplica : has(self.processesPerReplica) ? "
        f"self.processesPerReplica : (self.accelerator in {cel_list(cpu_classes)} ? {CPU_RANKS_DEFAULT} : "
        f"{GPU_RANKS_DEFAULT}))"
    )


def parallel_fit_rule(cpu_classes: tuple[str, ...] | list[str]) -> str:
    """CEL: model parallelism divides the ranks of one pod (rlfleet crds generates it from the catalog's
    CPU classes)."""
    return (
        f"{ranks_expr(cpu_classes)} % (self.parallelism.tensor * self.parallelism.pipeline * "
        "self.parallelism.context) == 0"
    )


BUILTIN_CPU_CLASSES: tuple[str, ...] = (
    "cpu",
)  # the built-in catalog's CPU classes (a test keeps them equal)
EXTERNAL_CPU_MESSAGE = (
    "trainer.external runs no training: its bridge pod (rlfleet slime bridge) runs on a CPU class: set "
    "trainer.accelerator to one (cpu)"
)


def external_cpu_rule(cpu_classes: tuple[str, ...] | list[str]) -> str:
    """CEL: an external trainer's bridge runs on a CPU class."""
    return f"!has(self.external) || self.accelerator in {cel_list(cpu_classes)}"


PARALLEL_FIT_RULE = parallel_fit_rule(BUILTIN_CPU_CLASSES)
PARALLEL_FIT_MESSAGE = (
    "trainer: parallelism tensor x pipeline x context must divide gpusPerReplica (processesPerReplica on a CPU "
    "class): each trainer pod holds whole model-parallel groups"
)
TRAINER_CPU_GPUS_MESSAGE = (
    "trainer: gpusPerReplica is for GPU classes; a CPU class (cpu) has no GPUs: set processesPerReplica "
    "(torchrun ranks per pod, gloo) instead"
)
TRAINER_GPU_PROCESSES_MESSAGE = (
    "trainer: processesPerReplica is for CPU classes (cpu); on a GPU class torchrun runs one rank per GPU: "
    "set gpusPerReplica instead"
)


def trainer_device_rules(cpu_classes: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """CEL rules: gpusPerReplica only on GPU classes, processesPerReplica only on CPU classes."""
    cpus = cel_list(cpu_classes)
    return [
        {
            "rule": f"!has(self.gpusPerReplica) || !(self.accelerator in {cpus})",
            "message": TRAINER_CPU_GPUS_MESSAGE,
            "fieldPath": ".gpusPerReplica",
        },
        {
            "rule": f"!has(self.processesPerReplica) || self.accelerator in {cpus}",
            "message": TRAINER_GPU_PROCESSES_MESSAGE,
            "fieldPath": ".processesPerReplica",
        },
    ]


# The torch backend (trainer/backends/backend_hf.py) is FSDP2 data parallel: one rank per GPU of ONE pod.
TORCH_ONE_NODE_RULE = (
    "self.backend != 'torch' || (self.replicas == 1 && "
    "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.context == 1)"
)
TORCH_ONE_NODE_MESSAGE = (
    "trainer: backend torch runs FSDP2 data parallel on one node (replicas 1, one rank per GPU of "
    "gpusPerReplica or per process of processesPerReplica, parallelism 1 x 1 x 1); use backend megatron for "
    "several nodes or tensor, pipeline or context parallelism"
)


def expert_fit_rule(cpu_classes: tuple[str, ...] | list[str]) -> str:
    """CEL: the trainer's ranks (every pod's) hold whole expert grids, expert tensor x expert parallelism."""
    expert_tp = (
        "(has(self.parallelism.expertTensor) ? self.parallelism.expertTensor : self.parallelism.tensor)"
    )
    return f"({ranks_expr(cpu_classes)} * self.replicas) % ({expert_tp} * self.parallelism.expert) == 0"


EXPERT_FIT_RULE = expert_fit_rule(BUILTIN_CPU_CLASSES)
EXPERT_FIT_MESSAGE = (
    "trainer: parallelism expertTensor (default: tensor) x expert must divide the trainer's ranks (replicas x "
    "gpusPerReplica, or processesPerReplica on a CPU class): expert parallelism splits a mixture of experts' "
    "experts over data-parallel ranks"
)
TORCH_NO_EXPERT_PARALLEL_RULE = (
    "self.backend != 'torch' || (self.parallelism.expert == 1 && !has(self.parallelism.expertTensor))"
)
TORCH_NO_EXPERT_PARALLEL_MESSAGE = (
    "trainer: parallelism expert / expertTensor are megatron's expert parallelism; backend torch has none (FSDP2 "
    "shards every expert's parameters over its ranks): use backend megatron, or leave them unset"
)
# Built-in environments of the trainer (rlfleet/trainer/envs/environments.py BUILTIN; a test keeps them equal).
BUILTIN_ENVIRONMENTS: tuple[str, ...] = ("copy_digit", "same_parity", "tool_add", "retry_digit", "math")
# Built-ins that read their prompts (and answers) from a prompt set, not generated ones.
DATASET_ENVIRONMENTS: tuple[str, ...] = ("math",)
DATASET_RULE = f"!(self.environment in {cel_list(DATASET_ENVIRONMENTS)}) || has(self.dataset)"
DATASET_MESSAGE = (
    "rollout.environment math needs rollout.dataset (a JSONL/Parquet prompt set with an answer column, "
    "docs/environments.md)"
)
ENTRY_POINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*$"
ENVIRONMENT_RULE = f"self.environment in {cel_list(BUILTIN_ENVIRONMENTS)} || self.environment.matches('{ENTRY_POINT_PATTERN}')"
ENVIRONMENT_MESSAGE = (
    f"rollout.environment must be a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}) or a "
    "module:attr entry point"
)
GROUP_SIZE_RULE = "self.samplesPerPrompt >= 2"
GROUP_SIZE_MESSAGE = (
    "samplesPerPrompt must be at least 2: advantages are group-relative (GRPO), with one sample per "
    "prompt every advantage is 0 and nothing is learned"
)
CONTEXT_RULE = "!has(self.model.maxSeqLen) || self.rollout.maxNewTokens < self.model.maxSeqLen"
CONTEXT_MESSAGE = "rollout.maxNewTokens must be < model.maxSeqLen (prompt and generation share the context)"
LOCAL_CONTEXT_RULE = "self.maxNewTokens < self.model.maxPositionEmbeddings"
LOCAL_CONTEXT_MESSAGE = (
    "local.maxNewTokens must be < local.model.maxPositionEmbeddings (prompt and generation share the context)"
)
# The one model whose config the API knows at apply: `builtin:tiny-qwen3` (rlfleet/tiny_qwen3.py, built by
# the trainer from these sizes, no download), a dense Qwen3. What it cannot run is refused here, not after
# apply: its mxfp4 view (the trainer refuses it, rlfleet/numerics/views.py `check_view_for_model`) and a
# tensor parallelism that does not divide its heads (SGLang and Megatron split heads across TP ranks).
BUILTIN_MODEL = "builtin:tiny-qwen3"
# rlfleet/tiny_qwen3.py SIZES (not imported: that module reaches torch; tests/api checks they agree)
_TINY_HEADS, _TINY_KV_HEADS = 2, 2
BUILTIN_MXFP4_RULE = (
    f"!self.model.path.startsWith('{BUILTIN_MODEL}') || self.samplerGroups.all(g, g.weightFormat != 'mxfp4')"
)
BUILTIN_MXFP4_MESSAGE = (
    f"model {BUILTIN_MODEL} is a dense Qwen3: it has no mxfp4 view (SGLang's mxfp4 quantizes MoE experts only and "
    "the trainer refuses the view, docs/weights.md); serve it in bf16, fp8 or nvfp4"
)
_TINY_TP = math.gcd(_TINY_HEADS, _TINY_KV_HEADS)  # a TP size must divide both head counts: it divides this
BUILTIN_TP_RULE = (
    f"!self.model.path.startsWith('{BUILTIN_MODEL}') || "
    f"(self.samplerGroups.all(g, !has(g.tensorParallel) || {_TINY_TP} % g.tensorParallel == 0) && "
    f"(!has(self.trainer.parallelism) || {_TINY_TP} % self.trainer.parallelism.tensor == 0))"
)
BUILTIN_TP_MESSAGE = (
    f"model {BUILTIN_MODEL} has {_TINY_HEADS} attention heads and {_TINY_KV_HEADS} key/value heads: every group's "
    "tensorParallel and trainer.parallelism.tensor must divide both (each tensor-parallel rank holds whole heads)"
)
TINY_HEADS_RULE = (
    "self.numAttentionHeads % self.numKeyValueHeads == 0 && self.headDim % 2 == 0 && self.hiddenSize % 128 == 0 "
    "&& self.intermediateSize % 128 == 0 && (self.numKeyValueHeads * self.headDim) % 128 == 0"
)
TINY_HEADS_MESSAGE = (
    "local.model: numAttentionHeads must be a multiple of numKeyValueHeads, headDim even (rotary embeddings), and "
    "hiddenSize, intermediateSize and numKeyValueHeads x headDim multiples of 128 (every projection then fits "
    "the fp8 view's 128 x 128 blocks)"
)
# rlfleet/tiny_qwen3.py `tool_add_demonstration`: BOS a b SEP, CALL x y END_CALL, RESULT s END_RESULT, answer EOS
WARM_START_CONTEXT = 13
WARM_START_RULE = (
    f"!has(self.warmStart) || self.warmStart == 'none' || self.maxPositionEmbeddings >= {WARM_START_CONTEXT}"
)
WARM_START_MESSAGE = (
    f"local.model.warmStart: a tool_add demonstration is {WARM_START_CONTEXT} tokens: maxPositionEmbeddings must be "
    f">= {WARM_START_CONTEXT}"
)
TINY_MOE_RULE = "self.numExpertsPerTok <= self.numExperts && self.moeIntermediateSize % 128 == 0"
TINY_MOE_MESSAGE = (
    "local.model: numExpertsPerTok must be <= numExperts, and moeIntermediateSize a multiple of 128 (each "
    "expert's projections then fit the fp8 view's 128 x 128 blocks)"
)
# Routing replay (R3, trainer/backends/routing_replay.py) hooks transformers' Qwen3-MoE router; the megatron backend
# routes with megatron-core's own TopKRouter, which takes no replayed experts, and the built-in model on a
# cluster is the dense tiny Qwen3.
ROUTING_REPLAY_MEGATRON_RULE = (
    "!has(self.correction.routingReplay) || !self.correction.routingReplay || self.trainer.backend == 'torch'"
)
ROUTING_REPLAY_MEGATRON_MESSAGE = (
    "correction.routingReplay needs trainer.backend: torch (transformers' Qwen3-MoE, as local mode trains): "
    "the megatron backend routes with megatron-core's own router, which has no routing replay"
)
ROUTING_REPLAY_DENSE_RULE = f"!has(self.correction.routingReplay) || !self.correction.routingReplay || !self.model.path.startsWith('{BUILTIN_MODEL}')"
ROUTING_REPLAY_DENSE_MESSAGE = (
    f"correction.routingReplay: model {BUILTIN_MODEL} is a dense Qwen3 (no experts, no routing to replay); "
    "replay needs a mixture of experts (Qwen3-MoE)"
)
ROUTING_REPLAY_LOCAL_DENSE_MESSAGE = (
    "correction.routingReplay: local.model.architecture qwen3 is dense (no experts, no routing to replay); "
    "set local.model.architecture: qwen3_moe"
)
TRAINER_ACCELERATOR_RULE = "self.suspend || self.trainer.accelerator == oldSelf.trainer.accelerator"
TRAINER_ACCELERATOR_MESSAGE = (
    "trainer.accelerator cannot change on an existing RLJob (the trainer pods would restart mid-run on other "
    "GPUs): set spec.suspend: true in the same change, or create a new job"
)
GROUP_ACCELERATOR_RULE = (
    "self.suspend || self.samplerGroups.all(g, !oldSelf.samplerGroups.exists(o, o.name == g.name && "
    "o.accelerator != g.accelerator))"
)
GROUP_ACCELERATOR_MESSAGE = (
    "samplerGroups[].accelerator cannot change on an existing group (its pods would restart mid-run on other "
    "GPUs): add a group under a new name and remove this one, or set spec.suspend: true in the same change"
)


class ModelSpec(ApiModel):
    """The policy model."""

    name: str = Field(min_length=1, max_length=253)
    """Model name (served model name of the samplers)."""
    path: str = Field(min_length=1, max_length=2048)
    """Initial weights: Hugging Face id, a path on the shared volume, an s3:// URI, or builtin:tiny-qwen3 (the project's tiny Qwen3, built by the trainer: no download)."""
    revision: str | None = Field(default=None, max_length=128)
    """Hugging Face revision (commit or tag)."""
    max_seq_len: int | None = Field(default=None, ge=16, le=1048576)
    """Context length (prompt + generation) used by trainer and samplers (none: the model's)."""


class ParallelismSpec(ApiModel):
    """Trainer model parallelism (Megatron-core)."""

    model_config = cel_rules({"rule": PIPELINE_RULE, "message": PIPELINE_MESSAGE, "fieldPath": ".pipeline"})

    tensor: int = Field(default=1, ge=1, le=64)
    """Tensor-parallel size."""
    pipeline: int = Field(default=1, ge=1, le=64)
    """Pipeline-parallel size (only 1 is supported yet)."""
    context: int = Field(default=1, ge=1, le=64)
    """Context-parallel size."""
    expert: int = Field(default=1, ge=1, le=256)
    """Expert-parallel size (megatron-core's expert_model_parallel_size, backend megatron): a mixture of experts' experts split over this many data-parallel ranks, each holding num_experts / expert of them. It must divide the model's experts (checked when the trainer starts: the trainer refuses, naming both); a dense model needs 1."""
    expert_tensor: int | None = Field(default=None, ge=1, le=64)
    """Tensor-parallel size inside each expert (megatron-core's expert_tensor_parallel_size). Unset: tensor; 1 keeps each expert whole on one rank."""

    @property
    def size(self) -> int:
        """GPUs of one model replica: tensor x pipeline x context."""
        return self.tensor * self.pipeline * self.context

    @model_validator(mode="after")
    def _check_pipeline(self) -> ParallelismSpec:
        if self.pipeline != 1:
            raise ValueError(PIPELINE_MESSAGE)
        return self


class OptimizerSpec(ApiModel):
    """Trainer optimizer (AdamW)."""

    learning_rate: float = Field(default=1e-6, gt=0.0, le=1.0)
    """Learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    """Decoupled weight decay."""
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Gradient clipping norm."""


# Tokens one trainer rank forwards and backwards at once (verl's ppo_max_token_len_per_gpu default): a
# sequence longer than this still trains, alone in its micro-batch (docs/objective.md, "Trainable length").
MAX_TOKENS_PER_MICRO_BATCH = 16384


class TrainerSpec(PodPlacement):
    """The BF16 trainer (a StatefulSet of torchrun ranks), placed as one gang (docs/scheduling.md)."""

    model_config = cel_rules(
        {"rule": PARALLEL_FIT_RULE, "message": PARALLEL_FIT_MESSAGE, "fieldPath": ".parallelism"},
        {"rule": TORCH_ONE_NODE_RULE, "message": TORCH_ONE_NODE_MESSAGE, "fieldPath": ".backend"},
        {"rule": EXPERT_FIT_RULE, "message": EXPERT_FIT_MESSAGE, "fieldPath": ".parallelism"},
        {
            "rule": TORCH_NO_EXPERT_PARALLEL_RULE,
            "message": TORCH_NO_EXPERT_PARALLEL_MESSAGE,
            "fieldPath": ".backend",
        },
        {"rule": LORA_BACKEND_RULE, "message": LORA_BACKEND_MESSAGE, "fieldPath": ".lora"},
        {"rule": EXTERNAL_MOUNT_RULE, "message": EXTERNAL_MOUNT_MESSAGE, "fieldPath": ".external.publishDir"},
        {"rule": EXTERNAL_LORA_RULE, "message": EXTERNAL_LORA_MESSAGE, "fieldPath": ".external"},
        {
            "rule": external_cpu_rule(BUILTIN_CPU_CLASSES),
            "message": EXTERNAL_CPU_MESSAGE,
            "fieldPath": ".accelerator",
        },
        *trainer_device_rules(BUILTIN_CPU_CLASSES),
        *POD_FIELDS_RULES,
    )

    accelerator: str = Field(
        default="b200", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
    )
    """Accelerator class of the trainer nodes (cpu: torchrun ranks on CPU with gloo, no GPU request)."""
    replicas: int = Field(default=1, ge=1, le=1024)
    """Number of trainer pods (torchrun nodes)."""
    gpus_per_replica: int | None = Field(default=None, ge=1, le=8)
    """GPUs per trainer pod on a GPU class (the nvidia.com/gpu request and torchrun --nproc-per-node: one rank per GPU). Unset: 8. Refused on a CPU class."""
    processes_per_replica: int | None = Field(default=None, ge=1, le=64)
    """torchrun ranks per trainer pod on a CPU class (--nproc-per-node, gloo; size CPU with resources). Unset: 1. Refused on a GPU class."""
    backend: Literal["megatron", "torch"] = "megatron"
    """Training backend: megatron (megatron-core: GPUs, or gloo on a CPU class) or torch (transformers + FSDP2 data parallel on one node)."""
    precision: Literal["bf16"] = "bf16"
    """Trainer precision (always BF16: the corrected objective absorbs the samplers' precision)."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, json_schema_extra={"default": {}})
    """Model parallelism."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, json_schema_extra={"default": {}})
    """Optimizer."""
    image: str = Field(default="ghcr.io/rlfleet/trainer:0.1.0", min_length=1, max_length=512)
    """Trainer image."""
    total_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps (none: run until deleted)."""
    max_tokens_per_micro_batch: int = Field(default=MAX_TOKENS_PER_MICRO_BATCH, ge=64, le=1 << 24)
    """Token budget of one micro-batch per rank: each rank's sequences are packed back to back, without padding (both backends), into micro-batches of at most this many tokens, gradients accumulated over them into one optimizer step. A longer sequence trains alone in its own micro-batch."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input in forward and recompute the layer in backward (torch: transformers' gradient checkpointing; megatron: full, uniform recompute): activation memory per micro-batch drops to about one hidden state per layer, for roughly one more forward of compute. The step is unchanged."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of full weights (backend torch). Absent: full fine-tuning."""
    external: ExternalTrainerSpec | None = None
    """A trainer outside the job (slime): no training pods; the bridge publishes its weight versions into the job's channel (docs/slime.md). Absent: rlfleet trains."""

    def on_cpu(self) -> bool:
        """Whether the trainer's class is a CPU class (the catalog in effect says)."""
        from rlfleet import catalog

        return not catalog.get_catalog().get(self.accelerator).gpu

    @property
    def ranks_per_replica(self) -> int:
        """torchrun --nproc-per-node: gpusPerReplica, processesPerReplica, or the class's default."""
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        if self.processes_per_replica is not None:
            return self.processes_per_replica
        return CPU_RANKS_DEFAULT if self.on_cpu() else GPU_RANKS_DEFAULT

    @property
    def gpus(self) -> int:
        """nvidia.com/gpu per trainer pod (0 on a CPU class)."""
        return 0 if self.on_cpu() else self.ranks_per_replica

    @model_validator(mode="after")
    def _check_fit(self) -> TrainerSpec:
        from rlfleet import catalog

        on_cpu = not catalog.get_catalog().get(self.accelerator).gpu
        if on_cpu and self.gpus_per_replica is not None:
            raise ValueError(
                f"{TRAINER_CPU_GPUS_MESSAGE} (accelerator {self.accelerator}, gpusPerReplica {self.gpus_per_replica})"
            )
        if not on_cpu and self.processes_per_replica is not None:
            raise ValueError(f"{TRAINER_GPU_PROCESSES_MESSAGE} (accelerator {self.accelerator})")
        size = self.parallelism.size
        ranks = self.ranks_per_replica
        if ranks % size:
            raise ValueError(f"{PARALLEL_FIT_MESSAGE}: {size} does not divide {ranks}")
        if self.backend == "torch" and (self.replicas, size) != (1, 1):
            raise ValueError(f"{TORCH_ONE_NODE_MESSAGE}: replicas {self.replicas}, parallelism size {size}")
        p = self.parallelism
        if self.backend == "torch" and (p.expert, p.expert_tensor) != (1, None):
            raise ValueError(TORCH_NO_EXPERT_PARALLEL_MESSAGE)
        if self.lora is not None and self.backend != "torch":
            raise ValueError(LORA_BACKEND_MESSAGE)
        self._check_external(on_cpu)
        grid = (p.tensor if p.expert_tensor is None else p.expert_tensor) * p.expert
        if (ranks * self.replicas) % grid:
            raise ValueError(f"{EXPERT_FIT_MESSAGE}: {grid} does not divide {ranks * self.replicas}")
        return self

    def _check_external(self, on_cpu: bool) -> None:
        """The pydantic side of the external trainer's CEL rules (same messages)."""
        if self.external is None:
            return
        if self.lora is not None:
            raise ValueError(EXTERNAL_LORA_MESSAGE)
        if not on_cpu:
            raise ValueError(f"{EXTERNAL_CPU_MESSAGE} (accelerator {self.accelerator})")
        publish = self.external.publish_dir
        mounts = [m.mount_path for m in self.volume_mounts]
        if not any(publish == m or publish.startswith(m.rstrip("/") + "/") for m in mounts):
            raise ValueError(EXTERNAL_MOUNT_MESSAGE)


SANDBOX_IMAGE_RULE = "self.backend != 'pods' || has(self.image)"
SANDBOX_IMAGE_MESSAGE = (
    "rollout.sandbox.backend pods needs rollout.sandbox.image (the sandbox pods' image: sh, git and python3, "
    "docs/environments.md 'Sandboxes in a cluster')"
)
SANDBOX_TEMPLATE_RULE = "self.backend != 'agent-sandbox' || has(self.template)"
SANDBOX_TEMPLATE_MESSAGE = (
    "rollout.sandbox.backend agent-sandbox needs rollout.sandbox.template (the name of the agent-sandbox "
    "SandboxTemplate of the task image in the job's namespace, docs/environments.md 'Sandboxes in a cluster')"
)


class SandboxSpec(ApiModel):
    """Where an environment's sandboxes run (the SWE environment's, rlfleet/sandbox): `local` (bubblewrap process trees in the trainer pod) or `pods` (one pod per sandbox in the job's namespace, commands through the API's exec; the operator then gives the trainer a ServiceAccount that may create, exec into and delete pods in this namespace, and a NetworkPolicy denies the sandbox pods all egress) or `agent-sandbox` (kubernetes-sigs/agent-sandbox, where the cluster runs its controller: one SandboxClaim per sandbox, owned by the trainer pod, on a warm pool of the job's SandboxTemplate, through its Python SDK, the `agent-sandbox` extra; the operator then gives the trainer a ServiceAccount that may create, list, watch and delete SandboxClaims and scale the pool in this namespace)."""

    model_config = cel_rules(
        {"rule": SANDBOX_IMAGE_RULE, "message": SANDBOX_IMAGE_MESSAGE, "fieldPath": ".image"},
        {"rule": SANDBOX_TEMPLATE_RULE, "message": SANDBOX_TEMPLATE_MESSAGE, "fieldPath": ".template"},
    )

    backend: Literal["local", "pods", "agent-sandbox"] = "local"
    """local: bubblewrap process trees in the trainer pod; pods: one sandbox pod per episode's sandbox; agent-sandbox: one SandboxClaim per episode's sandbox (needs agent-sandbox's controller in the cluster). For pods and agent-sandbox the operator gives the trainer a ServiceAccount with only the rights its backend uses, and each sandbox is owned by the trainer pod."""
    template: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The agent-sandbox SandboxTemplate of the task image (backend agent-sandbox), in the job's namespace: the trainer claims its sandboxes from the SandboxWarmPool `<job>-sandboxes` of this template (made if absent)."""
    image: str | None = Field(default=None, min_length=1, max_length=512)
    """The sandbox pods' image (backend pods): it needs sh, git and python3, and runs as uid 10001 on a read-only root."""
    runtime_class_name: str | None = Field(default=None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The sandbox pods' RuntimeClass (e.g. gvisor); none: the cluster's default runtime."""
    cpu: Quantity = "1"
    """CPU limit (and request) of a sandbox pod."""
    memory: Quantity = "2Gi"
    """Memory limit (and request) of a sandbox pod."""
    work_dir_size: Quantity = "1Gi"
    """Size limit of a sandbox pod's writable work dir and /tmp (emptyDir sizeLimit each)."""
    max_seconds: int = Field(default=3600, ge=60, le=86400)
    """A sandbox pod's activeDeadlineSeconds: the kubelet kills it after this long even if the trainer never deletes it."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of the sandbox pods (e.g. CPU nodes)."""
    warm_pool: int = Field(default=0, ge=0, le=1024)
    """Most idle sandbox pods kept started ahead of demand: the pool follows the sandboxes open now (one idle pod per in-flight episode's sandbox, up to this), so an episode or its grading usually takes a running pod instead of a cold start; 0: none. Backend agent-sandbox: the same target is the replicas of its SandboxWarmPool, set through the scale subresource."""

    @model_validator(mode="after")
    def _check_image(self) -> SandboxSpec:
        if self.backend == "pods" and self.image is None:
            raise ValueError(SANDBOX_IMAGE_MESSAGE)
        if self.backend == "agent-sandbox" and self.template is None:
            raise ValueError(SANDBOX_TEMPLATE_MESSAGE)
        return self


class RolloutSpec(ApiModel):
    """How rollouts are sampled."""

    model_config = cel_rules(
        {"rule": TOP_P_RULE, "message": TOP_P_MESSAGE},
        {
            "rule": GROUP_SIZE_RULE,
            "message": f"rollout.{GROUP_SIZE_MESSAGE}",
            "fieldPath": ".samplesPerPrompt",
        },
        {"rule": ENVIRONMENT_RULE, "message": ENVIRONMENT_MESSAGE, "fieldPath": ".environment"},
        {"rule": DATASET_RULE, "message": DATASET_MESSAGE, "fieldPath": ".dataset"},
    )

    prompts_per_step: int = Field(default=128, ge=1, le=65536)
    """Prompts per optimizer step."""
    samples_per_prompt: int = Field(default=8, ge=1, le=1024)
    """Samples per prompt (the GRPO group size, at least 2)."""
    temperature: float = Field(default=1.0, gt=0.0, le=10.0)
    """Sampling temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold. topP < 1 needs a finite topK (mask replay)."""
    top_k: int = Field(default=-1, ge=-1, le=MAX_TOP_K)
    """Top-k (-1: off). Must be finite (1..4096) when topP < 1."""
    max_new_tokens: int = Field(default=1024, ge=1, le=1048576)
    """Maximum generated tokens per turn."""
    max_turns: int = Field(default=1, ge=1, le=1024)
    """Maximum model turns per episode (multi-turn environments)."""
    dataset: str | None = Field(default=None, max_length=2048)
    """Prompt source: a JSONL path / URI, or builtin:<task> (none: the environment's built-in prompts)."""
    environment: str = Field(default="copy_digit", min_length=1, max_length=512)
    """Reward / environment entry point: module:attr, or a built-in name (copy_digit, same_parity, tool_add, retry_digit, math)."""
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    """Where the environment's sandboxes run (environments with a `sandbox`, e.g. rlfleet.trainer.envs.swe_env:SweEnv)."""

    @model_validator(mode="after")
    def _check_top_p(self) -> RolloutSpec:
        if self.top_p < 1.0 and not (1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(TOP_P_MESSAGE)
        if self.samples_per_prompt < 2:
            raise ValueError(f"rollout.{GROUP_SIZE_MESSAGE}")
        if self.environment not in BUILTIN_ENVIRONMENTS and not re.fullmatch(
            ENTRY_POINT_PATTERN, self.environment
        ):
            raise ValueError(f"{ENVIRONMENT_MESSAGE}: got {self.environment!r}")
        if self.environment in DATASET_ENVIRONMENTS and self.dataset is None:
            raise ValueError(DATASET_MESSAGE)
        return self


class CorrectionSpec(ApiModel):
    """The corrected objective (method.md)."""

    model_config = cel_rules({"rule": MIS_RULE, "message": MIS_MESSAGE})

    mode: CorrectionMode = "sc-mis-topp"
    """sc-mis-topp (score centering + masked IS + top-p mask replay), sc-mis, mis, sc, or none (plain GRPO)."""
    mis_low: float = Field(default=0.2, gt=0.0, le=1.0)
    """Lower edge c_min of the MIS band."""
    mis_high: float = Field(default=5.0, ge=1.0, le=1000.0)
    """Upper edge c_max of the MIS band."""
    sc_head_size: int = Field(default=128, ge=1, le=MAX_TOP_K)
    """Candidates recorded per token for score centering when no mask is replayed (top_logprobs_num)."""
    routing_replay: bool = False
    """Routing replay (R3), mixture-of-experts models: the trainer routes each token to the experts its sampler's router chose, weighted by the trainer's own router softmax over them, so the ratio's pi_theta is evaluated under the sampler's routing, not the trainer's own (a stated bias, docs/objective.md "Routing replay"). Needs trainer.backend torch and a Qwen3-MoE model."""

    @model_validator(mode="after")
    def _check_band(self) -> CorrectionSpec:
        if not self.mis_low < self.mis_high:
            raise ValueError(MIS_MESSAGE)
        return self


class StalenessSpec(ApiModel):
    """Bound on policy staleness."""

    max_steps: int | None = Field(default=None, ge=0, le=1000000)
    """Drop samples generated with weights more than this many versions old (none: unbounded, fully async)."""


class WeightChannelTemplate(ApiModel):
    """The run's weight channel."""

    store: StoreSpec
    """Where versions live."""
    retention: RetentionSpec = Field(default_factory=RetentionSpec, json_schema_extra={"default": {}})
    """Retention of old versions."""
    deltas: DeltaSpec = Field(default_factory=DeltaSpec, json_schema_extra={"default": {}})
    """Anchors and deltas between versions."""


class SafetySpec(ApiModel):
    """Collapse detection thresholds and what to do."""

    kl_surge_factor: float = Field(default=3.0, gt=1.0, le=1000.0)
    """Alert when a group's KL exceeds this multiple of its running baseline."""
    oor_share_factor: float = Field(default=2.0, gt=1.0, le=100.0)
    """Alert when a group's share of out-of-range tokens exceeds this multiple of its token share."""
    sc_tail_ratio_max: float = Field(default=5.0, gt=1.0)
    """Alert when the score-centering tail ratio rho exceeds this."""
    window_steps: int = Field(default=10, ge=1, le=10000)
    """Steps in the detector's window: the reward cliff compares the mean reward of the last windowSteps steps with its running peak; the running baselines average over about as many steps."""
    action: SafetyAction = "alert"
    """alert (condition + Event), quarantine-group (route no new sessions to the group), or pause (suspend the job)."""


class TinyModelSpec(ApiModel):
    """The tiny Qwen3 (or Qwen3-MoE) checkpoint `--local` builds and trains instead of `model.path` (Hugging
    Face config names; rlfleet/tiny_qwen3.py builds it with transformers and a local tokenizer)."""

    model_config = cel_rules(
        {"rule": TINY_HEADS_RULE, "message": TINY_HEADS_MESSAGE},
        {"rule": WARM_START_RULE, "message": WARM_START_MESSAGE, "fieldPath": ".maxPositionEmbeddings"},
        {"rule": TINY_MOE_RULE, "message": TINY_MOE_MESSAGE},
    )

    vocab_size: int = Field(default=64, ge=32, le=65536)
    """Vocabulary size (the toy environments' alphabet needs 32)."""
    hidden_size: int = Field(default=128, ge=128, le=8192)
    """Hidden size."""
    intermediate_size: int = Field(default=256, ge=128, le=32768)
    """SwiGLU MLP size."""
    num_hidden_layers: int = Field(default=2, ge=1, le=48)
    """Decoder layers."""
    num_attention_heads: int = Field(default=2, ge=1, le=64)
    """Query heads."""
    num_key_value_heads: int = Field(default=2, ge=1, le=64)
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    head_dim: int = Field(default=64, ge=2, le=512)
    """Per-head size."""
    max_position_embeddings: int = Field(default=64, ge=8, le=65536)
    """Context length."""
    tie_word_embeddings: bool = False
    """Use the embedding as the output projection."""
    logit_std: float = Field(default=2.0, gt=0, le=100.0)
    """Std of the untrained model's logits (peaked initial distributions; rlfleet/tiny_qwen3.py)."""
    warm_start: Literal["none", "tool_add"] = "none"
    """none: RL starts from the seeded random init; tool_add: from that init supervised for a few seconds on tool_add demonstrations whose copied digits are deliberately noisy, so RL starts at a low, non-zero task success (docs/local.md "The demo's warm start")."""

    architecture: Literal["qwen3", "qwen3_moe"] = "qwen3"
    """qwen3: the dense Qwen3; qwen3_moe: Qwen3-MoE, every layer's MLP numExperts routed experts of which each token uses the top numExpertsPerTok (no shared expert), trained with the router's load-balancing loss (docs/objective.md) and served by the reference engine."""
    num_experts: int = Field(default=4, ge=2, le=128)
    """qwen3_moe: routed experts per layer."""
    num_experts_per_tok: int = Field(default=2, ge=1, le=128)
    """qwen3_moe: experts each token is routed to (top-k of the router's softmax, renormalised)."""
    moe_intermediate_size: int = Field(default=128, ge=128, le=32768)
    """qwen3_moe: each expert's SwiGLU size."""
    router_aux_loss_coef: float = Field(default=0.001, ge=0, le=1.0)
    """qwen3_moe: weight of the router's load-balancing loss added to the policy loss."""

    @model_validator(mode="after")
    def _check_heads(self) -> TinyModelSpec:
        if (
            self.num_attention_heads % self.num_key_value_heads
            or self.head_dim % 2
            or self.hidden_size % 128
            or self.intermediate_size % 128
            or (self.num_key_value_heads * self.head_dim) % 128
        ):
            raise ValueError(TINY_HEADS_MESSAGE)
        if self.warm_start != "none" and self.max_position_embeddings < WARM_START_CONTEXT:
            raise ValueError(WARM_START_MESSAGE)
        if self.num_experts_per_tok > self.num_experts or self.moe_intermediate_size % 128:
            raise ValueError(TINY_MOE_MESSAGE)
        return self


INT64_MAX = 2**63 - 1


def _int64(value: int) -> int:
    """Refuse what Kubernetes cannot store (its integers are int64) and torch.manual_seed cannot take."""
    if value > INT64_MAX:
        raise ValueError(f"must be at most {INT64_MAX} (an int64)")
    return value


class LocalSpec(ApiModel):
    """Knobs for `rlfleet run --local` (one CPU machine). Ignored on clusters."""

    model_config = cel_rules(
        {"rule": GROUP_SIZE_RULE, "message": f"local.{GROUP_SIZE_MESSAGE}", "fieldPath": ".samplesPerPrompt"},
        {"rule": LOCAL_CONTEXT_RULE, "message": LOCAL_CONTEXT_MESSAGE, "fieldPath": ".maxNewTokens"},
    )

    steps: int = Field(default=20, ge=1, le=100000)
    """Optimizer steps of the local run."""
    prompts_per_step: int = Field(default=8, ge=1, le=4096)
    """Prompts per step (replaces rollout.promptsPerStep locally)."""
    samples_per_prompt: int = Field(default=4, ge=1, le=256)
    """Samples per prompt (replaces rollout.samplesPerPrompt locally)."""
    max_new_tokens: int = Field(default=8, ge=1, le=4096)
    """Generated tokens per turn (replaces rollout.maxNewTokens locally)."""
    # No `maximum` in the CRD: the API server reads schema bounds as float64, and 2^63 - 1 is no float64
    # integer ("Maximum boundary value must be of type integer"); format int64 bounds it there.
    seed: Annotated[int, AfterValidator(_int64)] = Field(
        default=0, ge=0, json_schema_extra={"format": "int64"}
    )
    """Seed of the tiny model, prompts and sampling (an int64, as Kubernetes stores integers; torch takes at most 2^64 - 1)."""
    learning_rate: float = Field(default=2e-4, gt=0, le=1.0)
    """Learning rate of the tiny model (trainer.optimizer.learningRate is sized for the real model)."""
    model: TinyModelSpec = Field(default_factory=TinyModelSpec, json_schema_extra={"default": {}})
    """The tiny model."""

    @model_validator(mode="after")
    def _check_local(self) -> LocalSpec:
        if self.samples_per_prompt < 2:
            raise ValueError(f"local.{GROUP_SIZE_MESSAGE}")
        if self.max_new_tokens >= self.model.max_position_embeddings:
            raise ValueError(LOCAL_CONTEXT_MESSAGE)
        return self


class RLJobSpec(ApiModel):
    """Desired state of an RLJob."""

    model_config = cel_rules(
        {
            "rule": STATIC_SHARES_GROUPS_RULE,
            "message": STATIC_SHARES_GROUPS_MESSAGE,
            "fieldPath": ".router.staticShares",
        },
        {"rule": FLEET_GROUPS_RULE, "message": FLEET_GROUPS_MESSAGE, "fieldPath": ".router.optimize.groups"},
        {"rule": CONTEXT_RULE, "message": CONTEXT_MESSAGE, "fieldPath": ".rollout.maxNewTokens"},
        {
            "rule": TRAINER_ACCELERATOR_RULE,
            "message": TRAINER_ACCELERATOR_MESSAGE,
            "fieldPath": ".trainer.accelerator",
        },
        {"rule": GROUP_ACCELERATOR_RULE, "message": GROUP_ACCELERATOR_MESSAGE, "fieldPath": ".samplerGroups"},
        {"rule": BUILTIN_MXFP4_RULE, "message": BUILTIN_MXFP4_MESSAGE, "fieldPath": ".samplerGroups"},
        {"rule": BUILTIN_TP_RULE, "message": BUILTIN_TP_MESSAGE, "fieldPath": ".samplerGroups"},
        {
            "rule": ROUTING_REPLAY_MEGATRON_RULE,
            "message": ROUTING_REPLAY_MEGATRON_MESSAGE,
            "fieldPath": ".correction.routingReplay",
        },
        {
            "rule": ROUTING_REPLAY_DENSE_RULE,
            "message": ROUTING_REPLAY_DENSE_MESSAGE,
            "fieldPath": ".correction.routingReplay",
        },
    )

    model: ModelSpec
    """The policy model."""
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, json_schema_extra={"default": {}})
    """The BF16 trainer."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}})
    """Sampling."""
    correction: CorrectionSpec = Field(default_factory=CorrectionSpec, json_schema_extra={"default": {}})
    """The corrected objective."""
    staleness: StalenessSpec = Field(default_factory=StalenessSpec, json_schema_extra={"default": {}})
    """Staleness bound."""
    sampler_groups: list[SamplerGroupTemplate] = Field(
        min_length=1,
        max_length=32,
        # a map keyed by name: server-side apply merges groups field by field (GitOps tools and the
        # API server's defaults co-own a group), and duplicate names are rejected; the CEL rule says why.
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [{"rule": GROUP_NAMES_RULE, "message": GROUP_NAMES_MESSAGE}],
        },
    )
    """Sampler groups: one per accelerator class + precision."""
    router: RouterSpec = Field(default_factory=RouterSpec, json_schema_extra={"default": {}})
    """Router and rebalancer."""
    weight_channel: WeightChannelTemplate
    """Weight channel store."""
    safety: SafetySpec = Field(default_factory=SafetySpec, json_schema_extra={"default": {}})
    """Collapse detection."""
    suspend: bool = False
    """Scale samplers and trainer to zero (resume restores them). Groups keep their replicas."""
    sampler_images: SamplerImages = Field(default_factory=SamplerImages, json_schema_extra={"default": {}})
    """Images of the sampler pods."""
    local: LocalSpec = Field(default_factory=LocalSpec, json_schema_extra={"default": {}})
    """Knobs for --local runs (ignored on clusters)."""

    @model_validator(mode="after")
    def _check_store_mount(self) -> RLJobSpec:
        # the trainer mounts a PVC-backed filesystem store at its path (operator/podspec.py store_volume)
        store = self.weight_channel.store
        if store.type == "filesystem" and store.volume_claim_name and store.path:
            path = store.path.rstrip("/")
            taken = [m.mount_path for m in self.trainer.volume_mounts if m.mount_path.rstrip("/") == path]
            if taken:
                raise ValueError(
                    f"trainer.volumeMounts: {taken[0]} is where the trainer mounts the weight store "
                    "(weightChannel.store.path): pick another mountPath"
                )
        return self

    @model_validator(mode="after")
    def _check_group_keys(self) -> RLJobSpec:
        names = {g.name for g in self.sampler_groups}
        for keys, message in (
            (self.router.static_shares, STATIC_SHARES_GROUPS_MESSAGE),
            (self.router.optimize.groups, FLEET_GROUPS_MESSAGE),
        ):
            unknown = sorted(set(keys) - names)
            if unknown:
                raise ValueError(f"{message} (unknown: {', '.join(unknown)})")
        return self

    @model_validator(mode="after")
    def _check_groups(self) -> RLJobSpec:
        names = [g.name for g in self.sampler_groups]
        if len(names) != len(set(names)):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{GROUP_NAMES_MESSAGE} (duplicated: {', '.join(dups)})")
        max_seq_len = self.model.max_seq_len
        if max_seq_len is not None and self.rollout.max_new_tokens >= max_seq_len:
            raise ValueError(f"{CONTEXT_MESSAGE}: {self.rollout.max_new_tokens} >= {max_seq_len}")
        if self.model.path.startswith(BUILTIN_MODEL):
            mxfp4 = [g.name for g in self.sampler_groups if g.weight_format == "mxfp4"]
            if mxfp4:
                raise ValueError(f"{BUILTIN_MXFP4_MESSAGE} (groups: {', '.join(mxfp4)})")
            sizes = {f"group {g.name}": g.tensor_parallel for g in self.sampler_groups if g.tensor_parallel}
            sizes["trainer"] = self.trainer.parallelism.tensor
            bad = [f"{who}: {tp}" for who, tp in sizes.items() if _TINY_TP % tp]
            if bad:
                raise ValueError(f"{BUILTIN_TP_MESSAGE} (got {', '.join(bad)})")
        if self.correction.routing_replay:
            if self.trainer.backend != "torch":
                raise ValueError(ROUTING_REPLAY_MEGATRON_MESSAGE)
            if self.model.path.startswith(BUILTIN_MODEL):
                raise ValueError(ROUTING_REPLAY_DENSE_MESSAGE)
        return self


class RLJob(KubeObject[RLJobSpec, RLJobStatus]):
    """An RLJob object (kind RLJob, short name rlj)."""

    kind: Literal["RLJob"] = "RLJob"
    """Kind."""

    @property
    def name(self) -> str:
        return self.metadata.name or "rljob"

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> RLJob:
        """Parse an RLJob manifest (dict from YAML or the API). Raises pydantic ValidationError."""
        job = cls.model_validate(kube_manifest_check(manifest, "RLJob"))
        name = job.metadata.name
        if name is not None and len(name) > MAX_JOB_NAME:
            raise ValueError(JOB_NAME_MESSAGE)
        if name is not None and not re.fullmatch(DNS_LABEL_PATTERN, name):
            raise ValueError(f"{JOB_NAME_DNS_MESSAGE}: got {name!r}")
        return job


class RLJobLoadError(ValueError):
    """An RLJob file cannot be read or is invalid (message is one clear paragraph, no stack trace)."""


def load_rljob(path: str | Path) -> RLJob:
    """Read and validate an RLJob YAML file. Raises RLJobLoadError with a readable message."""
    path = Path(path)
    try:
        docs = read_yaml(path, all_documents=True)
    except ValueError as exc:
        raise RLJobLoadError(f"{path}: {exc}") from None
    jobs = [d for d in docs if isinstance(d, dict) and d.get("kind") == "RLJob"]
    if len(jobs) != 1:
        raise RLJobLoadError(f"{path}: expected exactly one RLJob document, found {len(jobs)}")
    try:
        return RLJob.from_manifest(jobs[0])
    except ValidationError as exc:
        raise RLJobLoadError(f"{path}: invalid RLJob:\n{format_validation_error(exc)}") from None
    except ValueError as exc:
        raise RLJobLoadError(f"{path}: invalid RLJob: {exc}") from None


def format_validation_error(exc: ValidationError) -> str:
    """One line per error: `spec.rollout.topK: message` (camelCase paths, as in the YAML)."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)
