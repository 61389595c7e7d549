"""Pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema.

Structural means: every node has a type, no $ref / anyOf-of-types / additionalProperties: false next to
properties. Optional fields become `nullable: true`; `exclusiveMinimum: x` (JSON Schema 2020) becomes
OpenAPI 3.0's `minimum: x, exclusiveMinimum: true`; titles are dropped; descriptions, defaults,
bounds, enums, patterns and `x-kubernetes-*` extensions are kept.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

_KEEP = {
    "type",
    "description",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "nullable",
    "required",
}


class SchemaError(ValueError):
    """The model cannot be expressed as a structural schema."""


def model_openapi(model: type[BaseModel]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model (aliases = wire names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _expand_object_defaults(_convert(raw, defs, path=model.__name__))


def _child_defaults(node: dict[str, Any]) -> dict[str, Any]:
    return {name: sub["default"] for name, sub in node.get("properties", {}).items() if "default" in sub}


def _expand_object_defaults(node: dict[str, Any]) -> dict[str, Any]:
    """`default: {}` on an object becomes the object of its children's defaults (recursively).

    The API server validates CEL rules against a default as written (without applying nested
    defaults), so `{}` would fail a rule like `self.misLow < self.misHigh`; spelled out, the default
    also reads better in `kubectl explain`.
    """
    for sub in node.get("properties", {}).values():
        _expand_object_defaults(sub)
    if isinstance(node.get("items"), dict):
        _expand_object_defaults(node["items"])
    if node.get("type") == "object" and node.get("default") == {} and node.get("properties"):
        node["default"] = _child_defaults(node)
    return node


def _resolve(ref: str, defs: dict[str, Any]) -> dict[str, Any]:
    name = ref.rsplit("/", 1)[-1]
    if name not in defs:
        raise SchemaError(f"unresolvable $ref {ref}")
    return defs[name]


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = copy.deepcopy(node)
    if "$ref" in node or ("allOf" in node and len(node["allOf"]) == 1):
        return _convert(_inline_ref(node, defs), defs, path)
    if "anyOf" in node:
        return _finish(_convert(_unwrap_optional(node, defs, path), defs, path), nullable=True)
    if "const" in node:
        node["enum"] = [node.pop("const")]
    out: dict[str, Any] = {}
    for key, value in node.items():
        _convert_keyword(out, key, value, defs, path)
    if "type" not in out:
        raise SchemaError(f"{path}: no type (not structural): {node}")
    return _finish(out, nullable=False)


def _inline_ref(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """$ref (possibly with sibling description/default) or single-element allOf: inline the definition;
    the field's own description wins over the model's docstring. Pops the reference from `node`."""
    ref_node = node.pop("$ref", None) or node.pop("allOf")[0]
    target = _resolve(ref_node["$ref"], defs) if isinstance(ref_node, dict) else _resolve(ref_node, defs)
    merged = {**copy.deepcopy(target), **{k: v for k, v in node.items()}}
    if "x-kubernetes-validations" in target and "x-kubernetes-validations" in node:
        merged["x-kubernetes-validations"] = (
            target["x-kubernetes-validations"] + node["x-kubernetes-validations"]
        )
    return merged


def _unwrap_optional(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    """`anyOf: [X, null]` (an Optional field) -> X merged with the field's own keywords; the caller
    marks the result nullable. Any other union is not structural. Pops anyOf from `node`."""
    options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
    if len(options) != 1:
        raise SchemaError(f"{path}: unions of several types are not structural: {options}")
    inner = options[0]
    if "$ref" in inner:
        inner = {
            **copy.deepcopy(_resolve(inner["$ref"], defs)),
            **{k: v for k, v in inner.items() if k != "$ref"},
        }
    # the field's description/default win over the inner schema's
    return {**inner, **node}


def _convert_keyword(out: dict[str, Any], key: str, value: Any, defs: dict[str, Any], path: str) -> None:
    """Write one JSON Schema keyword's structural OpenAPI equivalent into `out` (or drop it)."""
    if key in _KEEP or key.startswith("x-kubernetes-"):
        out[key] = value
    elif key == "exclusiveMinimum":
        out["minimum"] = value
        out["exclusiveMinimum"] = True
    elif key == "exclusiveMaximum":
        out["maximum"] = value
        out["exclusiveMaximum"] = True
    elif key == "properties":
        out["properties"] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()}
    elif key == "items":
        out["items"] = _convert(value, defs, f"{path}[]")
    elif key == "additionalProperties":
        if isinstance(value, dict):
            out["additionalProperties"] = _convert(value, defs, f"{path}{{}}")
        # `false` (extra="forbid") is implied by structural pruning; `true` is not structural
    elif key not in ("title", "$defs", "examples"):
        raise SchemaError(f"{path}: JSON schema keyword {key!r} has no structural equivalent")


def _finish(out: dict[str, Any], nullable: bool) -> dict[str, Any]:
    if nullable:
        out["nullable"] = True
        if out.get("default", 0) is None:
            del out["default"]
    elif "default" in out and out["default"] is None:
        del out["default"]
    if "required" in out and not out["required"]:
        del out["required"]
    return out


def walk(schema: dict[str, Any], path: str = ""):
    """Yield (path, node) for every node of a structural schema."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")
