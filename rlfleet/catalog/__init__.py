"""The accelerator catalog and the engine launch it selects, one module per question:

- `classes`: which accelerator classes exist (built-in, or overridden by `RLFLEET_CATALOG`), how to find
  their nodes, what each can run, and the checks a sampler group must pass (`check_group`);
- `launch`: the ONE pure function turning (group, class) into the command line of the engine the class
  runs (`engine_launch`: SGLang or the reference engine), and the launch file a pod starts it from.

Callers import the names from `rlfleet.catalog`. Core package: imports nothing of the product packages
(and not kopf or torch).
"""

from rlfleet.catalog.classes import (
    CATALOG_ENV,
    CPU_SAMPLER_RESOURCES,
    CPU_SYNC_RESOURCES,
    CPU_TRAINER_RESOURCES,
    GKE_LABEL,
    GPU_RESOURCE,
    GPU_SAMPLER_RESOURCES,
    GPU_SYNC_RESOURCES,
    GPU_TOLERATION,
    GPU_TRAINER_RESOURCES,
    PRODUCT_LABEL,
    REFERENCE_ONE_PROCESS,
    AcceleratorClass,
    Catalog,
    CatalogError,
    FormatProfile,
    GroupPrecision,
    builtin_classes,
    catalog_from_mapping,
    check_group,
    check_tensor_parallel,
    get_catalog,
    group_precision,
    kv_note,
    load_catalog,
    selection_reason,
)
from rlfleet.catalog.launch import (
    LAUNCH_FILE,
    MODEL_DIR_REF,
    REFERENCE_PROGRAM,
    WEIGHT_VERSION_REF,
    SGLangLaunch,
    engine_launch,
    engine_launch_for_group,
    launch_from_file,
    reference_launch,
    sglang_launch,
)

__all__ = [
    "CATALOG_ENV",
    "CPU_SAMPLER_RESOURCES",
    "CPU_SYNC_RESOURCES",
    "CPU_TRAINER_RESOURCES",
    "GKE_LABEL",
    "GPU_RESOURCE",
    "GPU_SAMPLER_RESOURCES",
    "GPU_SYNC_RESOURCES",
    "GPU_TOLERATION",
    "GPU_TRAINER_RESOURCES",
    "LAUNCH_FILE",
    "MODEL_DIR_REF",
    "PRODUCT_LABEL",
    "REFERENCE_ONE_PROCESS",
    "REFERENCE_PROGRAM",
    "WEIGHT_VERSION_REF",
    "AcceleratorClass",
    "Catalog",
    "CatalogError",
    "FormatProfile",
    "GroupPrecision",
    "SGLangLaunch",
    "builtin_classes",
    "catalog_from_mapping",
    "check_group",
    "check_tensor_parallel",
    "engine_launch",
    "engine_launch_for_group",
    "get_catalog",
    "group_precision",
    "kv_note",
    "launch_from_file",
    "load_catalog",
    "reference_launch",
    "selection_reason",
    "sglang_launch",
]
