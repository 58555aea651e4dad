"""Tool-argument checking with jsonschema: what the model is told, and the hit-path memory."""

from __future__ import annotations

from bunshin.tools import schema


def test_arguments_found_valid_are_remembered_per_schema_only():
    """The hit path skips re-validating repeated calls; that memory never crosses schemas."""
    loose = {"type": "object", "properties": {"n": {"type": "integer"}}}
    strict = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}
    assert schema.errors(loose, {"n": 5}) == []
    assert schema.errors(loose, {"n": 5}) == []  # remembered
    assert schema.errors(strict, {"n": 5}) == ["arguments.n: must be <= 3"]
    assert schema.errors(dict(strict), {"n": 5}) == ["arguments.n: must be <= 3"]  # same content, new object
    assert schema.errors(loose, {"n": "5"}) == ["arguments.n: expected integer, got str"]
