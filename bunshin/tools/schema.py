"""A small JSON-schema checker for tool arguments.

Covers what function-calling schemas use: ``type`` (one or a list), ``properties``,
``required``, ``additionalProperties`` (bool or schema), ``items``, ``enum``,
``minimum``/``maximum``, ``minLength``/``maxLength``, ``minItems``/``maxItems``.
Errors name the argument path, so the model can correct its call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (Mapping,),
    "null": (type(None),),
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    if kind in ("integer", "number") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES.get(kind, (object,)))


def errors(schema: Mapping[str, Any], value: Any, path: str = "arguments") -> list[str]:
    """Everything wrong with ``value`` against ``schema`` (empty when it conforms)."""
    out: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is(value, k) for k in kinds):
            got = "null" if value is None else type(value).__name__
            return [f"{path}: expected {' or '.join(kinds)}, got {got}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: must be one of {list(schema['enum'])}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            out.append(f"{path}: shorter than {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{path}: longer than {schema['maxLength']} characters")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{path}: must be >= {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{path}: must be <= {schema['maximum']}")
    if isinstance(value, list | tuple):
        if len(value) < schema.get("minItems", 0):
            out.append(f"{path}: needs at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: takes at most {schema['maxItems']} items")
        if isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                out += errors(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, Mapping):
        props: Mapping[str, Any] = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                out.append(f"{path}: missing required {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in props:
                out += errors(props[name], item, f"{path}.{name}")
            elif extra is False:
                allowed = ", ".join(props) or "none"
                out.append(f"{path}: unexpected {name!r} (allowed: {allowed})")
            elif isinstance(extra, Mapping):
                out += errors(extra, item, f"{path}.{name}")
    return out


def with_defaults(schema: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` plus the ``default`` of every top-level property not given."""
    out = dict(args)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and isinstance(prop, Mapping) and "default" in prop:
            out[name] = prop["default"]
    return out
