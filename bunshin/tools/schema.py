"""Tool arguments checked against their JSON schema, with ``jsonschema``.

Schemas are read as draft 2020-12 (what function-calling schemas are written in),
with two widenings the tools rely on: any ``Mapping`` is an object and a tuple is
an array. jsonschema finds the problems; this module words them for the model:
each message names the argument path (``arguments.items[2]``) so the model can
correct its call, and a value of the wrong type gets that one message only.
An invalid schema is the tool author's mistake and raises ``InvalidArgument``.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jsonschema import Draft202012Validator, SchemaError, ValidationError, validators
from jsonschema.protocols import Validator

from ..errors import InvalidArgument

_CHECKER = Draft202012Validator.TYPE_CHECKER.redefine_many({
    "object": lambda _checker, value: isinstance(value, Mapping),
    "array": lambda _checker, value: isinstance(value, list | tuple),
})
_extend: Callable[..., type[Validator]] = validators.extend  # the stubs leave it untyped
_ToolArgsValidator = _extend(Draft202012Validator, type_checker=_CHECKER)


@functools.lru_cache(maxsize=256)
def _checked(canonical: str) -> Validator:
    schema = json.loads(canonical)
    try:
        _ToolArgsValidator.check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path) or "at the top"
        raise InvalidArgument(f"invalid JSON schema for tool arguments ({where}): {exc.message}") from None
    return _ToolArgsValidator(schema)


#: Validators by the identity of the schema object (a tool's spec keeps its schema for life),
#: with the schema's canonical text: a call on the cache's hit path re-serialises no schema.
_BY_ID: dict[int, tuple[Mapping[str, Any], Validator, str]] = {}


def _validator(schema: Mapping[str, Any]) -> tuple[Validator, str]:
    """A validator of ``schema`` (checked once: tool schemas are few) and its canonical text."""
    known = _BY_ID.get(id(schema))
    if known is not None and known[0] is schema:
        return known[1], known[2]
    try:
        canonical = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"invalid JSON schema for tool arguments: not JSON ({exc})") from None
    validator = _checked(canonical)
    if len(_BY_ID) >= 1024:
        _BY_ID.clear()
    _BY_ID[id(schema)] = (schema, validator, canonical)  # holding the schema keeps its id unused
    return validator, canonical


def _path(root: str, parts: Iterable[str | int]) -> str:
    return root + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)


def _kinds(types: str | Iterable[str]) -> list[str]:
    return [types] if isinstance(types, str) else list(types)


def _extra_names(schema: Mapping[str, Any], value: Mapping[str, Any]) -> list[str]:
    props = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [n for n in value if n not in props and not any(re.search(p, n) for p in patterns)]


def _messages(err: ValidationError, path: str) -> list[str]:
    """``err`` in the words the model sees (one or more lines)."""
    kw = err.validator
    want: Any = err.validator_value
    value: Any = err.instance
    schema = err.schema if isinstance(err.schema, Mapping) else {}
    if kw == "type":
        got = "null" if value is None else type(value).__name__
        return [f"{path}: expected {' or '.join(_kinds(want))}, got {got}"]
    if kw == "required":
        return [f"{path}: missing required {n!r}" for n in want if n not in value]
    if kw == "additionalProperties" and want is False:
        allowed = ", ".join(schema.get("properties", {})) or "none"
        return [f"{path}: unexpected {n!r} (allowed: {allowed})" for n in _extra_names(schema, value)]
    match kw:
        case "enum":
            text = f"must be one of {list(want)}"
        case "minLength":
            text = f"shorter than {want} characters"
        case "maxLength":
            text = f"longer than {want} characters"
        case "minimum":
            text = f"must be >= {want}"
        case "maximum":
            text = f"must be <= {want}"
        case "minItems":
            text = f"needs at least {want} items"
        case "maxItems":
            text = f"takes at most {want} items"
        case _:
            text = err.message
    return [f"{path}: {text}"]


#: Arguments already found valid, by validator and content: agents repeat calls (that is
#: what the prefix cache serves), and jsonschema takes ~10 us for even a small object.
_VALID: set[tuple[str, str]] = set()
_VALID_MAX = 65536


def _content_key(schema: str, value: Any) -> tuple[str, str] | None:
    try:
        return schema, json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):  # not plain JSON (a Mapping subclass...): check it every time
        return None


def errors(schema: Mapping[str, Any], value: Any, path: str = "arguments") -> list[str]:
    """Everything wrong with ``value`` against ``schema`` (empty when it conforms)."""
    validator, canonical = _validator(schema)
    key = _content_key(canonical, value)
    if key is not None and key in _VALID:
        return []
    if validator.is_valid(value):  # the common case: no error objects made
        if key is not None:
            if len(_VALID) >= _VALID_MAX:
                _VALID.clear()
            _VALID.add(key)
        return []
    found = list(validator.iter_errors(value))
    mistyped = {tuple(e.absolute_path) for e in found if e.validator == "type"}
    out: list[str] = []
    for err in found:
        where = tuple(err.absolute_path)
        if where in mistyped and err.validator != "type":
            continue  # the wrong type says it all
        for line in _messages(err, _path(path, where)):
            if line not in out:
                out.append(line)
    return out


def with_defaults(schema: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` plus the ``default`` of every top-level property not given."""
    out = dict(args)
    for name, prop in schema.get("properties", {}).items():
        if name not in out and isinstance(prop, Mapping) and "default" in prop:
            out[name] = prop["default"]
    return out
