"""The local, remote and fake workspaces satisfy the workspace protocols, signature by signature.

mypy checks the same statically (``_conforms`` in workspace.py and testing/fake.py);
this holds it at run time too, parameter names and kinds included, so a remote
implementation can be held to it the same way.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from bunshin import (
    CommandsAPI,
    FilesAPI,
    SessionsAPI,
    Snapshot,
    SnapshotAPI,
    Workspace,
    WorkspaceAPI,
)
from bunshin.client import Client
from bunshin.client.remote import (
    RemoteCommands,
    RemoteFiles,
    RemoteSessions,
    RemoteSnapshot,
    RemoteWorkspace,
)
from bunshin.testing import FakeSnapshot, FakeWorld
from bunshin.testing.fake import FakeCommands, FakeFiles, FakeSessions
from bunshin.workspace import LocalHost
from bunshin.workspace.protocol import HostAPI
from bunshin.workspace.workspace import Commands, Files, Sessions

PAIRS = [
    (WorkspaceAPI, Workspace), (WorkspaceAPI, "fake-ws"),
    (SnapshotAPI, Snapshot), (SnapshotAPI, FakeSnapshot),
    (CommandsAPI, Commands), (CommandsAPI, FakeCommands),
    (FilesAPI, Files), (FilesAPI, FakeFiles),
    (SessionsAPI, Sessions), (SessionsAPI, FakeSessions),
    (WorkspaceAPI, RemoteWorkspace), (SnapshotAPI, RemoteSnapshot), (CommandsAPI, RemoteCommands),
    (FilesAPI, RemoteFiles), (SessionsAPI, RemoteSessions),
    (HostAPI, LocalHost), (HostAPI, Client),
]


def _members(proto: type) -> list[str]:
    return sorted(n for n in proto.__dict__ if not n.startswith("_"))


def _params(fn: Any) -> list[tuple[str, Any, bool]]:
    sig = inspect.signature(fn)
    return [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values() if p.name != "self"]


def _substitutes(want: list[tuple[str, Any, bool]], have: list[tuple[str, Any, bool]]) -> bool:
    """The protocol's parameters, in order, with the same kinds and defaults; anything more
    the implementation takes must be optional (``Files.read(path, *, offset=0)`` is fine)."""
    return have[: len(want)] == want and all(has_default for _, _, has_default in have[len(want):])


def _impl(cls: type | str) -> type:
    if cls == "fake-ws":
        return type(FakeWorld().create())
    assert isinstance(cls, type)
    return cls


@pytest.mark.parametrize(("proto", "cls"), PAIRS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_every_protocol_member_is_implemented_with_the_same_parameters(proto, cls):
    impl = _impl(cls)
    wrong = []
    for name in _members(proto):
        want = inspect.getattr_static(proto, name)
        if isinstance(want, property):
            # a property, or an attribute set in __init__ (``self.commands = Commands(self)``)
            if not hasattr(impl, name) and f"self.{name} = " not in inspect.getsource(impl.__init__):
                wrong.append(f"{name}: missing")
            continue
        have = getattr(impl, name, None)
        if have is None:
            wrong.append(f"{name}: missing")
        elif not _substitutes(_params(want), _params(have)):
            wrong.append(f"{name}: {_params(have)} does not take protocol {_params(want)}")
    assert not wrong, wrong


def test_fake_objects_are_protocol_instances():
    world = FakeWorld()
    ws = world.create()
    snap = ws.snapshot()
    assert isinstance(ws, WorkspaceAPI) and isinstance(snap, SnapshotAPI)
    assert isinstance(ws.commands, CommandsAPI) and isinstance(ws.files, FilesAPI)
    assert isinstance(ws.sessions, SessionsAPI)
    assert not isinstance(object(), WorkspaceAPI)  # the check can fail


@pytest.mark.integration
def test_a_real_workspace_is_a_protocol_instance(family):
    ws = family.create()
    assert isinstance(ws, WorkspaceAPI)
    assert isinstance(ws.sessions, SessionsAPI) and isinstance(ws.files, FilesAPI)


def test_the_check_refuses_what_would_not_substitute():
    """The rule above can fail: a missing, renamed or newly required parameter is refused."""
    want = [("path", inspect.Parameter.POSITIONAL_OR_KEYWORD, False)]
    kw = inspect.Parameter.KEYWORD_ONLY
    assert _substitutes(want, want + [("offset", kw, True)])
    assert not _substitutes(want, [])
    assert not _substitutes(want, [("where", inspect.Parameter.POSITIONAL_OR_KEYWORD, False)])
    assert not _substitutes(want, want + [("offset", kw, False)])
