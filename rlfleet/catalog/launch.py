"""A sampler group's engine launch: the ONE pure function turning (group, class) into the command line
of the engine the class runs (SGLang, or the reference engine with the same launch contract).

Every quantized format launches from a checkpoint already in that format (a published view of the
weight channel: config.json carries the `quantization_config`), never from a BF16 checkpoint with an
online `--quantization`: `/update_weights_from_disk` reloads into the launch-time model with its
launch-time quantization method, and online FP8 / online ModelOpt FP4 cannot take a later checkpoint
(docs/weights.md). The `--quantization` value each profile passes is the one SGLang's
`ModelConfig._verify_quantization` resolves from that checkpoint's config, so it only confirms what the
checkpoint says. It is no guard against a checkpoint of another format (SGLang refuses some pairs and
silently runs others, tests/api/test_api_catalog.py), so the weight-sync init container checks the
checkpoint's declared quantization before SGLang starts (the sampler's `check_launchable`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.catalog.classes import (
    AcceleratorClass,
    Catalog,
    CatalogError,
    check_group,
    check_tensor_parallel,
    get_catalog,
    selection_reason,
)
from rlfleet.hf_config import is_moe_config

if TYPE_CHECKING:
    from rlfleet.api.lora_spec import LoraSpec

LAUNCH_FILE = "launch"
"""File in a sampler pod's weights cache naming the checkpoint SGLang launches from: a line
"<version> <directory>", then, when that checkpoint needs any, a line of the SGLang flags it needs
(`checkpoint_engine_flags` of its config.json, space-separated), written atomically by the weight-sync
init container (before SGLang starts) and rewritten by the sidecar after every applied version (a
restarted engine container launches from what the pod serves). The sampler's weight sync writes it
(rlfleet/sampler/launch_checkpoint.py `write_launch_file`); `launch_from_file` reads it."""
WEIGHT_VERSION_REF = "$RLFLEET_WEIGHT_VERSION"
MODEL_DIR_REF = "$RLFLEET_MODEL_DIR"
"""Placeholders for `sglang_launch(weight_version=..., model_path=...)` that `launch_from_file` fills
from the launch file at container start."""
CHECKPOINT_FLAGS_VAR = "RLFLEET_CHECKPOINT_FLAGS"
"""The shell variable `launch_from_file` reads the launch file's flag line into."""
RETURN_ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""SGLang 0.5.23's switch for `meta_info.routed_experts` (ServerArgs.enable_return_routed_experts)."""


def checkpoint_engine_flags(config: Mapping[str, Any] | None) -> list[str]:
    """THE function deciding the SGLang flags a checkpoint's own config.json calls for (None: a view
    without one), beyond the group's (`sglang_launch`): the operator builds a pod before the model is
    known, so these are decided where the checkpoint is, at pod start (docs/weights.md, "Launch").

    A mixture of experts (`is_moe_config`) gets `--enable-return-routed-experts`, so that the trainer,
    which asks for each token's routed experts of a MoE (`SamplingConfig.routed_experts_top_k`), gets
    them. Never for a dense model: SGLang's RoutedExpertsCapturer, built at launch under that flag,
    reads the config's `num_experts_per_tok`, which a dense config lacks (the launch fails)."""
    if config is not None and is_moe_config(config):
        return [RETURN_ROUTED_EXPERTS_FLAG]
    return []


# A LoRA group's engine holds at most 4 adapters and batches at most 3 distinct ones, SGLang counting the
# base as one: version N+1 loads and takes new requests while requests on N finish in the same batches,
# and the base-model generation probe (/health_generate, the router's readiness) still fits beside both
# (with 2, it would wait behind every version handover). 4 loaded: room for SGLang's implicit reload of a
# just-unloaded version a late request still names, without evicting N or N+1 (docs/sampler.md, "LoRA").
LORA_MAX_LORAS_PER_BATCH = 3
LORA_MAX_LOADED_LORAS = 4


def lora_engine_flags(lora: LoraSpec | None) -> list[str]:
    """The engine flags of a group serving LoRA adapters (`spec.lora`; none without): SGLang 0.5.23's
    (server_args `lora` namespace), which the reference engine takes with the same meaning. The rank and
    the modules are the adapters' own, so every version's adapter fits the engine's LoRA memory pool."""
    if lora is None:
        return []
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(lora.rank),
        "--lora-target-modules",
        *lora.target_modules,
        "--max-loras-per-batch",
        str(LORA_MAX_LORAS_PER_BATCH),
        "--max-loaded-loras",
        str(LORA_MAX_LOADED_LORAS),
    ]


REFERENCE_PROGRAM = "rlfleet"
"""argv[0] of a reference-engine group's engine container (the rlfleet console script of the image)."""


@dataclass(frozen=True)
class SGLangLaunch:
    """Everything needed to start one SGLang server of a group."""

    argv: list[str]  # full command line, argv[0] is the interpreter
    env: dict[str, str]
    tensor_parallel: int
    mode: Literal["native", "degraded"]
    note: str
    accelerator: str
    selection_reason: str = ""
    flags: list[str] = field(default_factory=list)  # the precision flags alone (format + kv)

    @property
    def degraded(self) -> bool:
        return self.mode == "degraded"


def engine_launch(
    *,
    accelerator: AcceleratorClass,
    weight_format: str,
    kv_cache_dtype: str = "auto",
    tensor_parallel: int | None = None,
    extra_args: Sequence[str] = (),
    model_path: str,
    served_model_name: str,
    weight_version: int | str,
    host: str = "0.0.0.0",
    port: int = 30000,
    sampling_mask_max_tokens: int = 4096,
    python: str = "python3",
    program: str = REFERENCE_PROGRAM,
    lora: LoraSpec | None = None,
) -> SGLangLaunch:
    """THE pure function: (group fields, class) -> the command line + env of the engine the class runs
    (`engine`). Raises CatalogError.

    SGLang (`python -m sglang.launch_server`, `python` its interpreter): `model_path` is a checkpoint
    already in `weight_format` (the channel's view of that format, whose config.json carries the
    quantization_config the precision flags confirm); `weight_version` is the version of that
    checkpoint, always passed: without it SGLang labels every token "default" until the first update.
    The reference engine (`<program> sampler serve --engine reference`, a class with `engine:
    reference`): the same launch inputs (a verified view directory and its version, the served name,
    port, mask cap) and the class's precision flags (`--weight-format`, `--kv-cache-dtype`); one process,
    no tensor parallelism. `lora` (a group's `spec.lora`): both engines get `lora_engine_flags`, and
    `model_path` is the group's base view. `engine_launch_for_group` takes a SamplerGroup spec directly; this form takes
    plain values so the sampler (`rlfleet sampler serve --engine sglang`) and local mode need no API
    object.
    """
    cls = accelerator
    catalog = Catalog(classes={cls.name: cls}, source=f"class {cls.name}")
    profile = check_group(cls.name, weight_format, kv_cache_dtype, catalog=catalog)
    if cls.engine == "reference":
        check_tensor_parallel(cls, tensor_parallel)
        tp = 1
        command = [program, "sampler", "serve", "--engine", "reference"]
        engine_flags: list[str] = []
    else:
        tp = tensor_parallel or cls.default_tensor_parallel
        command = [python, "-m", "sglang.launch_server"]
        engine_flags = ["--tp-size", str(tp), "--dtype", "bfloat16", "--enable-metrics"]
    precision_flags = list(profile.flags)
    if kv_cache_dtype != "auto":
        precision_flags += ["--kv-cache-dtype", kv_cache_dtype]
    argv = [
        *command,
        "--model-path",
        model_path,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        *engine_flags,
        "--sampling-mask-max-tokens",
        str(sampling_mask_max_tokens),
        "--weight-version",
        str(weight_version),
        *precision_flags,
        *lora_engine_flags(lora),
        *extra_args,
    ]
    return SGLangLaunch(
        argv=argv,
        env={**cls.env, **profile.env},
        tensor_parallel=tp,
        mode=profile.mode,
        note=profile.note,
        accelerator=cls.name,
        selection_reason=selection_reason(cls, weight_format, profile),
        flags=precision_flags,
    )


def sglang_launch(*, accelerator: AcceleratorClass, **inputs: Any) -> SGLangLaunch:
    """`engine_launch` of a class that runs SGLang (the sampler's `--engine sglang`); CatalogError for a
    class that runs another engine."""
    if accelerator.engine != "sglang":
        engine = f"accelerator {accelerator.name} runs the {accelerator.engine} engine"
        raise CatalogError(f"{engine}, not SGLang (use engine_launch)")
    return engine_launch(accelerator=accelerator, **inputs)


def reference_launch(*, accelerator: AcceleratorClass, **inputs: Any) -> SGLangLaunch:
    """`engine_launch` of a class that runs the reference engine; CatalogError for a class that runs
    another engine."""
    if accelerator.engine != "reference":
        raise CatalogError(
            f"accelerator {accelerator.name} runs the {accelerator.engine} engine, not the reference engine"
        )
    return engine_launch(accelerator=accelerator, **inputs)


def launch_from_file(argv: Sequence[str], launch_file: str, *, checkpoint_flags: bool) -> list[str]:
    """`/bin/sh -c` command running `argv` (built with WEIGHT_VERSION_REF / MODEL_DIR_REF) with the
    version and directory read from `launch_file`'s first line; `checkpoint_flags` (SGLang's argv): with
    the flags of its second line appended (`checkpoint_engine_flags`; none when the line is absent). The
    reference engine takes none of them (it returns a MoE's routed experts unasked). Fails (exit 1, one
    line) if the file is missing: the init container did not finish, so there is nothing verified to
    launch from."""
    refs = {WEIGHT_VERSION_REF, MODEL_DIR_REF}
    words = [f'"{a}"' if a in refs else shlex.quote(a) for a in argv]
    file = shlex.quote(launch_file)
    read = f"read -r {WEIGHT_VERSION_REF[1:]} {MODEL_DIR_REF[1:]}"
    run = f"exec {' '.join(words)}"
    if checkpoint_flags:
        # the flag line is split into words (flags never hold spaces) with globbing off (set -f)
        read = f"{{ {read} && {{ read -r {CHECKPOINT_FLAGS_VAR} || :; }}; }}"
        run = f"set -f && {run} ${CHECKPOINT_FLAGS_VAR}"
    script = (
        f"test -s {file} || {{ echo 'no verified weights: {launch_file} missing' >&2; exit 1; }}; "
        f"{read} < {file} && {run}"
    )
    return ["/bin/sh", "-c", script]


def engine_launch_for_group(group: Any, catalog: Catalog | None = None, **kwargs: Any) -> SGLangLaunch:
    """engine_launch for a SamplerGroupSpec / SamplerGroupTemplate: SGLang or the reference engine, as the
    group's class says (model_path and weight_version come from kwargs; the served name defaults to
    group.model.name)."""
    return _launch_for_group(engine_launch, group, catalog, **kwargs)


def _launch_for_group(launch: Any, group: Any, catalog: Catalog | None, **kwargs: Any) -> SGLangLaunch:
    cat = catalog or get_catalog()
    model = getattr(group, "model", None)
    kwargs.setdefault("served_model_name", getattr(model, "name", None))
    if getattr(group, "port", None) is not None:
        kwargs.setdefault("port", group.port)
    if getattr(group, "sampling_mask_max_tokens", None) is not None:
        kwargs.setdefault("sampling_mask_max_tokens", group.sampling_mask_max_tokens)
    missing = [k for k in ("model_path", "served_model_name", "weight_version") if kwargs.get(k) is None]
    if missing:
        raise CatalogError(f"engine launch: {', '.join(missing)} required")
    return launch(
        accelerator=cat.get(group.accelerator),
        weight_format=group.weight_format,
        kv_cache_dtype=group.kv_cache_dtype,
        tensor_parallel=group.tensor_parallel,
        extra_args=group.extra_args,
        lora=getattr(group, "lora", None),
        **kwargs,
    )
