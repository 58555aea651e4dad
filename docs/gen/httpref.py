"""The HTTP reference: the server's OpenAPI document (built from the FastAPI app, no server
run) as Markdown, one section per route, grouped by the path's first segment."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

METHODS = ("get", "post", "put", "patch", "delete", "head")


def openapi() -> dict[str, Any]:
    from bunshin.api.models import ErrorOut
    from bunshin.config import Config
    from bunshin.server.app import create_app

    with tempfile.TemporaryDirectory(prefix="bunshin-docs-") as tmp:
        cfg = Config(home=Path(tmp) / "home", tmpfs=Path(tmp) / "tmpfs")
        spec = create_app(cfg, token="docs").openapi()
    # every error answers with this body (the app's exception handlers, not declared per route)
    spec["components"]["schemas"].setdefault("ErrorOut", ErrorOut.model_json_schema())
    return spec


def dumps(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2, sort_keys=True) + "\n"


def _ref(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        return f"array of {_ref(schema['items'])}"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_ref(s) for s in schema[key])
    return f"`{schema.get('type', 'any')}`"


def _body(op: dict[str, Any]) -> str:
    content = op.get("requestBody", {}).get("content", {})
    parts = [f"{_ref(c.get('schema', {}))} ({ctype})" for ctype, c in content.items()]
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _route(path: str, method: str, op: dict[str, Any]) -> list[str]:
    out = [f"#### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**", ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = op.get("parameters", [])
    if params:
        out += ["| parameter | in | type | required |", "|---|---|---|---|"]
        out += [f"| `{p['name']}` | {p['in']} | {_ref(p.get('schema', {}))} | {'yes' if p.get('required') else 'no'} |"
                for p in params]
        out.append("")
    if _body(op):
        out += [f"Body: {_body(op)}", ""]
    answers = []
    for status, r in sorted(op.get("responses", {}).items()):
        schema = next(iter(r.get("content", {}).values()), {}).get("schema")
        answers.append(f"`{status}` {_cell(r.get('description', ''))}" + (f": {_ref(schema)}" if schema else ""))
    if answers:
        out += ["Answers: " + "; ".join(answers), ""]
    return out


def _schema(name: str, schema: dict[str, Any]) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [_cell(schema["description"]), ""]
    props = schema.get("properties", {})
    if props:
        required = set(schema.get("required", []))
        out += ["| field | type | required | default |", "|---|---|---|---|"]
        for field, p in props.items():
            default = f"`{json.dumps(p['default'])}`" if "default" in p else ""
            out.append(f"| `{field}` | {_ref(p)} | {'yes' if field in required else 'no'} | {_cell(default)} |")
        out.append("")
    elif "enum" in schema:
        out += ["One of: " + ", ".join(f"`{v}`" for v in schema["enum"]), ""]
    return out


def render(spec: dict[str, Any]) -> str:
    out = ["# HTTP API reference", "",
           f"Generated from the server's OpenAPI document (version {spec['info']['version']}) at build "
           "time; the document itself: [openapi.json](openapi.json). A running `bunshin serve` also "
           "serves it at `/openapi.json` and an explorer at `/docs`. Every route but "
           "`GET /v1/health` needs `Authorization: Bearer <token>`; errors answer with "
           "[`ErrorOut`](#errorout) (`code`, `message`, `hint`, `details`). How to run the server: "
           "[Serve over HTTP](../guides/serve.md).", ""]
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in spec["paths"].items():
        seg = [s for s in path.split("/") if s and s != "v1"]
        group = seg[0] if seg and not seg[0].startswith("{") else "other"
        for method in METHODS:
            if method in item:
                groups.setdefault(group, []).append((path, method, item[method]))
    out += ["## Routes", ""]
    for group in sorted(groups):
        out += [f"### /{group}", ""]
        for path, method, op in groups[group]:
            out += _route(path, method, op)
    out += ["## Schemas", ""]
    for name, schema in sorted(spec.get("components", {}).get("schemas", {}).items()):
        out += _schema(name, schema)
    return "\n".join(out)
