"""The wire spec (``bunshin/agent/wire.py``) ties the agent, the host client and ``bunshin.errors``.

Everything here is enumerated from the wire module, not copied: a code, an op or a
field added on one side only makes a test fail.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from bunshin import errors
from bunshin.agent import protocol, wire
from bunshin.agent.server import Agent, AgentServer
from bunshin.agent.wire import SPEC, ErrorCode, Op
from bunshin.errors import BunshinError, InvalidArgument
from bunshin.runtime.agent_host import bundle as agent_bundle
from bunshin.runtime.agent_host import client as agent_client
from bunshin.runtime.agent_host.client import AgentClient
from bunshin.runtime.agent_host.types import (
    AgentInfo,
    ExecResult,
    FileEntry,
    ProcessInfo,
    SessionInfo,
    SessionResult,
)

# --- error codes ----------------------------------------------------------------------


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_agent_error_code_is_an_error_class(code: ErrorCode) -> None:
    cls = errors.error_class(code)
    assert cls is not BunshinError, f"no class in bunshin/errors.py has the code {code!r}"
    assert cls.code == code


def _answering_agent(path: Path, answer: bytes) -> threading.Thread:
    """A socket that reads one request line and answers ``answer``."""
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                wire.LineReader(conn.recv).readline()
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("code", list(ErrorCode))
def test_the_client_raises_that_class(tmp_path: Path, code: ErrorCode) -> None:
    """The agent's own encoding of a failure, through the real client."""
    thread = _answering_agent(tmp_path / "a.sock", protocol.failure(protocol.AgentFailure(code, "it broke")))
    with pytest.raises(BunshinError) as info:
        AgentClient(tmp_path / "a.sock").ping()
    thread.join(5)
    assert type(info.value) is errors.error_class(code)
    assert info.value.message == "it broke"


def test_the_agent_cannot_raise_a_code_the_wire_does_not_know() -> None:
    with pytest.raises(ValueError):
        protocol.AgentFailure("no_such_code", "x")  # type: ignore[arg-type]


# --- ops ------------------------------------------------------------------------------


def test_the_agent_serves_exactly_the_wire_ops(tmp_path: Path) -> None:
    agent = Agent(str(tmp_path / "run"))
    assert set(agent.handlers) | {Op.JOB_START, Op.JOB_WAIT, Op.TRIM} == set(Op) == set(SPEC)
    for op in Op:
        assert protocol.parse_request(wire.request_line(op, {})[:-1])[wire.OP] == op
    with pytest.raises(protocol.AgentFailure) as info:
        protocol.parse_request(b'{"op": "no_such_op"}')
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert set(wire.RESUMABLE_OPS) == {Op.EXEC, Op.SESSION_RUN}


def test_the_client_speaks_every_op_and_only_declared_arguments(
    client: AgentClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[dict[str, Any]] = []
    real = wire.request_line

    def recording(op: str, args: Any) -> bytes:
        line = real(op, args)
        sent.append(json.loads(line))
        return line

    monkeypatch.setattr(wire, "request_line", recording)
    client.ping()
    client.identify({"workspace": "w"})
    client.exec(["true"])
    pid = client.spawn(cmd="sleep 30")
    client.kill(pid)
    client.processes()
    client.write_file(tmp_path / "f", "x")
    client.read_file(tmp_path / "f")
    client.list_dir(tmp_path)
    client.stat(tmp_path / "f")
    client.remove(tmp_path / "f")
    sid = client.session_open()
    client.session_run(sid, "true")
    client.session_list()
    client.session_close(sid)
    client.attach().close()
    client.trim()

    requests = sent + [r[wire.JOB_REQUEST] for r in sent if wire.JOB_REQUEST in r]
    assert {r[wire.OP] for r in requests} == set(Op)
    for r in requests:
        assert set(r) - {wire.OP} <= SPEC[Op(r[wire.OP])].request, r


def test_the_client_refuses_what_the_spec_does_not_allow(tmp_path: Path) -> None:
    nobody = AgentClient(tmp_path / "nobody.sock")  # never reached: refused before connecting
    with pytest.raises(InvalidArgument, match="takes no argument 'bogus'"):
        nobody.call(Op.PING, bogus=1)
    with pytest.raises(InvalidArgument, match="takes no argument"):
        nobody.call(Op.EXEC, argv=["true"], bogus=1)
    with pytest.raises(InvalidArgument, match="unknown op"):
        nobody.call("no_such_op")


# --- fields ---------------------------------------------------------------------------


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_client_types_are_the_declared_answers() -> None:
    assert _fields(AgentInfo) == SPEC[Op.PING].answer
    assert _fields(ExecResult) <= SPEC[Op.EXEC].answer
    assert _fields(SessionResult) == SPEC[Op.SESSION_RUN].answer
    assert _fields(FileEntry) == wire.ENTRY_FIELDS == SPEC[Op.STAT].answer
    assert _fields(ProcessInfo) == wire.PROCESS_FIELDS
    assert _fields(SessionInfo) == wire.SESSION_FIELDS


def test_the_agent_answers_declared_fields(client: AgentClient, tmp_path: Path) -> None:
    os.symlink("nowhere", tmp_path / "link")
    for entry in client.call(Op.LIST_DIR, path=str(tmp_path))["entries"]:
        assert set(entry) <= wire.ENTRY_FIELDS
    for proc in client.call(Op.PROCESSES)["processes"]:
        assert set(proc) == wire.PROCESS_FIELDS
    sid = client.session_open()
    try:
        for session in client.call(Op.SESSION_LIST)["sessions"]:
            assert set(session) == wire.SESSION_FIELDS
    finally:
        client.session_close(sid)
    for binary in (None, True):
        answer = client.call(Op.EXEC, argv=["true"], binary=binary)
        assert set(answer) <= SPEC[Op.EXEC].answer


def test_the_agent_refuses_to_read_an_undeclared_argument() -> None:
    with pytest.raises(protocol.AgentFailure) as info:
        protocol.arg_str({"op": "ping", "path": "/"}, "path")
    assert info.value.code == ErrorCode.AGENT_ERROR
    assert protocol.arg_path({"op": "stat", "path": "/"}) == "/"


def test_the_agent_refuses_to_answer_an_undeclared_field(tmp_path: Path) -> None:
    agent = Agent(str(tmp_path / "run"))
    agent.handlers[Op.PING] = lambda req: {"pid": 1, "surprise": True}
    answer = json.loads(AgentServer(agent, str(tmp_path / "s.sock"))._answer(b'{"op": "ping"}'))
    assert answer[wire.OK] is False
    assert answer[wire.ERROR][wire.CODE] == ErrorCode.AGENT_ERROR and "surprise" in answer[wire.ERROR][wire.MESSAGE]


def test_an_undeclared_field_read_by_the_client_says_so() -> None:
    answer = agent_client._Answer(Op.PING, {})
    with pytest.raises(errors.AgentError, match="lacks 'pid'"):
        answer["pid"]
    with pytest.raises(errors.AgentError, match="does not declare"):
        answer["surprise"]


# --- framing --------------------------------------------------------------------------


def _chunks(*parts: bytes) -> Any:
    data = list(parts)
    return lambda n: data.pop(0) if data else b""


def test_lines_are_framed_and_ascii() -> None:
    line = wire.encode({"name": "caf\u00e9 \udcff"})
    assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
    assert wire.request_line(Op.STAT, {"path": "/", "unused": None}) == b'{"op":"stat","path":"/"}\n'
    reader = wire.LineReader(_chunks(b'{"a":1}\n{"b"', b':2}\nrest'))
    assert wire.decode(reader.readline() or b"") == {"a": 1}
    assert wire.decode(reader.readline() or b"") == {"b": 2}
    assert bytes(reader.buffer) == b"rest"
    with pytest.raises(wire.LineCut):
        reader.readline()
    assert wire.LineReader(_chunks()).readline() is None
    with pytest.raises(wire.LineTooLong):
        wire.LineReader(_chunks(b"x" * 10, b"y" * 10), limit=8).readline()


# --- the bundle -----------------------------------------------------------------------


def test_the_agent_imports_only_modules_the_bundle_copies() -> None:
    """The bundle copies ``bunshin/agent/*.py`` (no sub-packages); every relative import
    of the agent, the wire module among them, must be one of those files."""
    shipped = {p.stem for p in agent_bundle.AGENT_SRC.glob("*.py")}
    assert "wire" in shipped
    for path in agent_bundle.AGENT_SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name}: import from outside the agent package"
                names = [node.module] if node.module else [a.name for a in node.names]
                assert set(names) <= shipped, f"{path.name} imports {names}, not all shipped"


def test_the_built_bundle_ships_the_wire_and_runs_it(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    agent_bundle._build(layer)
    root = layer / ".bunshin"
    assert (root / "agent" / "bunshin_agent" / "wire.py").is_file()
    probe = "import bunshin_agent.server, bunshin_agent.wire as w; print(w.VERSION, sorted(w.SPEC) == sorted(w.Op))"
    r = subprocess.run(
        [str(root / "python" / "bin" / "python3"), "-s", "-B", "-c", probe],
        env={"PYTHONHOME": str(root / "python"), "PYTHONPATH": str(root / "agent")},
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [wire.VERSION, "True"]
