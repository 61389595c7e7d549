"""PURE: the published model's head counts, and whether a group's tensor parallelism fits them.

The API cannot know a Hugging Face model's config at apply (only `builtin:tiny-qwen3`'s, refused there:
rlfleet/api/rljob.py). The operator learns it from the weight channel: the trainer publishes version 0
of every view from the base checkpoint before step 1, each view a Hugging Face checkpoint with its
config.json. The operator reads that file once (`ModelShape` in the WeightChannel status, kept), and a
group whose tensorParallel does not split the heads evenly is Failed with the numbers before its pods,
which wait for version 0 in their init container, start SGLang and crash on it (docs/operations.md).

SGLang's rule (QKVParallelLinear): every rank holds whole query heads (num_attention_heads % tp == 0), and
key/value heads are split when tp divides them or replicated when they divide tp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CONFIG_FILE = "config.json"


def model_shape(config: Mapping[str, Any], version: int) -> dict[str, Any] | None:
    """The WeightChannel status' `model` from a Hugging Face config (None: it names no head count)."""
    heads = config.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = config.get("num_key_value_heads")
    kv = kv if isinstance(kv, int) and kv >= 1 else heads
    shape: dict[str, Any] = {"attentionHeads": heads, "keyValueHeads": kv, "version": version}
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        shape["architecture"] = ",".join(str(a) for a in architectures)[:253]
    return shape


def tensor_parallel_problem(shape: Mapping[str, Any] | None, tensor_parallel: int) -> str | None:
    """Why a group of `tensor_parallel` ranks cannot serve this model, or None (it can, or unknown)."""
    if not shape:
        return None
    heads, kv = int(shape["attentionHeads"]), int(shape["keyValueHeads"])
    if heads % tensor_parallel == 0 and (kv % tensor_parallel == 0 or tensor_parallel % kv == 0):
        return None
    fits = [tp for tp in range(1, 9) if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]
    model = shape.get("architecture") or "the model"
    return (
        f"tensorParallel {tensor_parallel} does not split {model}'s {heads} attention heads and {kv} key/value "
        f"heads evenly (read from {CONFIG_FILE} of weight version {shape.get('version')}): SGLang gives every "
        f"rank whole heads; use tensorParallel {', '.join(map(str, fits))}"
    )
