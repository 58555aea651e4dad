"""Tool specs, argument checking, canonical keys and the built-ins, over the fake workspace."""

from __future__ import annotations

import json

import pytest

from bunshin.testing import FakeWorld
from bunshin.tools import Observation, ToolSet, call_key, command_tool, function_tool
from bunshin.tools.schema import errors
from tests.fakes import WORKDIR


@pytest.fixture
def ws():
    world = FakeWorld()
    w = world.create(workdir=WORKDIR)
    yield w
    w.remove()


@pytest.fixture
def tools() -> ToolSet:
    return ToolSet.default(workdir=WORKDIR)


def test_default_set_and_openai_format(tools):
    names = [t["function"]["name"] for t in tools.openai_tools()]
    assert names == ["bash", "read_file", "write_file", "edit", "python"]
    for t in tools.openai_tools():
        assert t["type"] == "function"
        assert t["function"]["parameters"]["type"] == "object"
        assert t["function"]["description"]
        json.dumps(t)  # plain JSON
    assert tools.spec("read_file").read_only and not tools.spec("bash").read_only
    assert all(t.spec.deterministic for t in tools)


def test_call_key_is_canonical(tools):
    a = call_key("edit", {"path": "x", "old_str": "a", "new_str": "b"})
    b = call_key("edit", {"new_str": "b", "old_str": "a", "path": "x"})
    assert a == b
    assert call_key("t", {"n": 1.0}) == call_key("t", {"n": 1})
    assert call_key("t", {"n": 1}) != call_key("u", {"n": 1})
    # defaults are part of the meaning: giving them or not is the same call
    _, given = tools.check("edit", {"path": "x", "old_str": "a", "new_str": "b", "replace_all": False})
    _, left = tools.check("edit", {"path": "x", "old_str": "a", "new_str": "b"})
    assert tools.key("edit", given) == tools.key("edit", left)
    # the JSON text a model produced is accepted too
    _, parsed = tools.check("bash", '{"command": "ls"}')
    assert parsed == {"command": "ls"}


@pytest.mark.parametrize(
    ("schema", "value", "fragment"),
    [
        ({"type": "object", "required": ["a"]}, {}, "missing required 'a'"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": "1"}, "arguments.a: expected integer"),
        ({"type": "object", "properties": {}, "additionalProperties": False}, {"b": 1}, "unexpected 'b'"),
        ({"type": "string", "enum": ["x", "y"]}, "z", "must be one of"),
        ({"type": "array", "items": {"type": "string"}}, ["a", 2], "arguments[1]: expected string"),
        ({"type": "integer", "minimum": 1}, 0, "must be >= 1"),
        ({"type": "boolean"}, 1, "expected boolean"),
    ],
)
def test_schema_errors(schema, value, fragment):
    assert any(fragment in e for e in errors(schema, value)), errors(schema, value)


def test_schema_accepts_conforming_values():
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "tags": {"type": "array"}},
              "required": ["n"], "additionalProperties": False}
    assert errors(schema, {"n": 1.5, "tags": []}) == []
    assert errors({"type": "integer"}, 3.0) == []


@pytest.mark.parametrize(
    ("name", "args", "fragment"),
    [
        ("nosuch", {}, "unknown tool 'nosuch'"),
        ("bash", {}, "missing required 'command'"),
        ("bash", {"command": 3}, "expected string"),
        ("bash", "{not json", "not JSON"),
        ("bash", ["ls"], "expected an object"),
        ("read_file", {"path": "a", "bogus": 1}, "unexpected 'bogus'"),
        ("edit", {"path": "a", "old_str": "", "new_str": "b"}, "shorter than 1"),
    ],
)
def test_invalid_calls_are_observations(ws, tools, name, args, fragment):
    obs = tools.run_sync(ws, name, args)
    assert isinstance(obs, Observation)
    assert obs.error and fragment in obs.error and obs.exit_code is None and not obs.ok
    assert "error:" in obs.text()


def test_bash_reuses_the_first_session(ws, tools):
    assert tools.run_sync(ws, "bash", {"command": "export A=5"}).ok
    obs = tools.run_sync(ws, "bash", {"command": "echo $A"})
    assert obs.output == "5\n" and obs.exit_code == 0
    assert len(ws.sessions.list()) == 1
    assert tools.run_sync(ws, "bash", {"command": "exit 3"}).exit_code == 3


def test_file_tools(ws, tools):
    assert tools.run_sync(ws, "write_file", {"path": "a.txt", "content": "one\ntwo\nthree\n"}).ok
    assert ws.files.read(f"{WORKDIR}/a.txt") == b"one\ntwo\nthree\n"
    assert tools.run_sync(ws, "read_file", {"path": "a.txt"}).output == "one\ntwo\nthree\n"
    assert tools.run_sync(ws, "read_file", {"path": f"{WORKDIR}/a.txt", "start_line": 2, "end_line": 2}).output == "two\n"
    assert "no such file" in tools.run_sync(ws, "read_file", {"path": "missing"}).error
    assert "past the end" in tools.run_sync(ws, "read_file", {"path": "a.txt", "start_line": 9}).error


def test_edit_errors_and_replace_all(ws, tools):
    tools.run_sync(ws, "write_file", {"path": "e.py", "content": "x = 1\ny = 1\n"})
    nf = tools.run_sync(ws, "edit", {"path": "e.py", "old_str": "z = 1", "new_str": "z = 2"})
    assert "not found" in nf.error
    nu = tools.run_sync(ws, "edit", {"path": "e.py", "old_str": "= 1", "new_str": "= 2"})
    assert "occurs 2 times" in nu.error
    assert ws.files.read(f"{WORKDIR}/e.py") == b"x = 1\ny = 1\n"  # unchanged by the failed edits
    assert tools.run_sync(ws, "edit", {"path": "e.py", "old_str": "x = 1", "new_str": "x = 2"}).ok
    assert tools.run_sync(ws, "edit", {"path": "e.py", "old_str": "= ", "new_str": "=", "replace_all": True}).ok
    assert ws.files.read(f"{WORKDIR}/e.py") == b"x =2\ny =1\n"
    assert "no such file" in tools.run_sync(ws, "edit", {"path": "nope", "old_str": "a", "new_str": "b"}).error


def test_command_tool(ws):
    tool = command_tool("say", "echo {word} {other}", read_only=True)
    assert tool.spec.parameters["required"] == ["other", "word"]
    tools = ToolSet([tool], workdir=WORKDIR)
    assert tools.run_sync(ws, "say", {"word": "hi", "other": "there"}).output == "hi there\n"
    assert "missing required" in tools.run_sync(ws, "say", {"word": "x"}).error
    with pytest.raises(ValueError):
        command_tool("bad", "echo {0}")


def _grep(pattern: str, path: str = ".", count: int = 3, ignore_case: bool = False) -> str:
    """Search files."""
    return f"{pattern}:{path}:{count}:{ignore_case}"


def test_function_tool_schema_from_signature():
    tool = function_tool(_grep, read_only=True)
    assert tool.spec.name == "_grep" and tool.spec.description == "Search files."
    params = tool.spec.parameters
    assert params["required"] == ["pattern"]
    assert params["properties"]["count"] == {"type": "integer", "default": 3}
    assert params["properties"]["ignore_case"]["type"] == "boolean"
    tools = ToolSet([tool])
    assert "expected integer" in tools.run_sync(None, "_grep", {"pattern": "a", "count": "x"}).error


def test_duplicate_names_are_refused(tools):
    with pytest.raises(ValueError):
        tools.command("bash", "echo hi")
    tools.command("bash", "echo hi", replace=True)
    assert tools.spec("bash").description == "Run: echo hi"


def test_read_file_reads_no_more_than_it_shows(ws, tools, monkeypatch):
    """Over the fake: every read the tool makes is bounded, whatever the file's size; line ranges
    that cross the pieces it reads in come out whole, the last line without its newline too."""
    from bunshin.tools import builtin

    asked: list[int | None] = []
    real = type(ws.files).read

    def counting(self, path, *, offset=0, length=None):
        asked.append(length)
        return real(self, path, offset=offset, length=length)

    monkeypatch.setattr(type(ws.files), "read", counting)
    monkeypatch.setattr(builtin, "SCAN_CHUNK", 7)  # lines cross the pieces
    ws.files.write(f"{WORKDIR}/big", b"y" * (3 * builtin.MAX_READ_BYTES))
    asked.clear()
    out = tools.run_sync(ws, "read_file", {"path": "big"}).output
    assert out.startswith("y" * 100) and out.endswith("[... cut at 256 KiB; read a line range]")
    assert asked == [builtin.MAX_READ_BYTES + 1]
    ws.files.write(f"{WORKDIR}/lines", b"".join(b"line %d\n" % i for i in range(1, 1001)) + b"tail")
    asked.clear()
    got = tools.run_sync(ws, "read_file", {"path": "lines", "start_line": 3, "end_line": 5}).output
    assert got == "line 3\nline 4\nline 5\n" and len(asked) <= 7 and all(n == 7 for n in asked)
    assert tools.run_sync(ws, "read_file", {"path": "lines", "start_line": 1000}).output == "line 1000\ntail"
    assert tools.run_sync(ws, "read_file", {"path": "lines", "start_line": 1001}).output == "tail"
    assert "1001 lines" in tools.run_sync(ws, "read_file", {"path": "lines", "start_line": 1002}).error


def test_edit_refuses_a_file_too_large_to_edit_whole(ws, tools, monkeypatch):
    from bunshin.tools import builtin

    monkeypatch.setattr(builtin, "MAX_TEXT_FILE_BYTES", 1000)
    ws.files.write(f"{WORKDIR}/huge", b"a" * 1001)
    err = tools.run_sync(ws, "edit", {"path": "huge", "old_str": "a", "new_str": "b", "replace_all": True}).error
    assert "too large to edit whole" in err and ws.files.read(f"{WORKDIR}/huge") == b"a" * 1001
