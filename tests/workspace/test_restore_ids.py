"""Integration: a snapshot restored under ids the caller gives (E2B's resumed sandbox keeps
its id): a removed workspace comes back under its own id; an id in use, repeated, malformed
or missing is refused before anything is made."""

from __future__ import annotations

import pytest

from bunshin.errors import InvalidArgument, StateConflict
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_restore_under_given_ids(family):
    ws = family.create()
    ws.files.write("/tmp/mark", "kept\n")
    snap = family.snapshot(ws)
    other = family.create()
    for ids, error in (([other.id], StateConflict), (["ws-nothex"], InvalidArgument),
                       (["ws-0123456789ab", "ws-0123456789ab"], InvalidArgument), ([], InvalidArgument)):
        n = max(len(ids), 1)
        with pytest.raises(error):
            snap.restore(n, ids=ids)
    assert {i.id for i in Workspace.list(config=family.cfg)} == {ws.id, other.id}  # nothing made

    gone = ws.id
    ws.remove()
    (back,) = snap.restore(1, ids=[gone])
    family.workspaces.append(back)
    assert back.id == gone and back.files.read("/tmp/mark") == b"kept\n"
