"""Integration: a deleted-but-open file (a "ghost", as Chromium keeps its shared memory
and databases keep spill files) larger than CRIU's own 1 MiB limit survives a fork
(issue 16).

The fork dumps with ``--ghost-limit`` = ``Config.ghost_limit`` (256 MiB unless
configured): CRIU copies the file's bytes into the snapshot's images (counted in its
size) and each clone gets a private copy. Above the limit the fork is refused with
``NotForkable`` naming the process, the file, its size and the limit, and the
workspace runs on as before.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from bunshin.errors import InvalidArgument, NotForkable
from bunshin.workspace import Workspace
from tests.conftest import leftovers
from tests.workspace.test_fork import ask, wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

MIB = 1 << 20
GHOST_MIB = 64

# Writes GHOST_MIB MiB of a deterministic pattern to /tmp/ghost, keeps it open, deletes
# it; then answers requests as the fork tests' probe does: "sum" = the sha256 of the
# open file's bytes, "poke" = overwrite its first 4 KiB with this workspace's mark.
GHOSTPROG = r"""
import hashlib, os, sys, time
mib = int(sys.argv[1])
f = open("/tmp/ghost", "w+b")
for i in range(mib):
    f.write(hashlib.sha256(b"%d" % i).digest() * (1 << 15))
f.flush()
os.unlink("/tmp/ghost")
def digest():
    f.seek(0)
    h = hashlib.sha256()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()
with open("/tmp/probe.ready", "w") as r:
    r.write(digest())
while True:
    try:
        req = open("/tmp/probe.req").read().split()
    except FileNotFoundError:
        time.sleep(0.01)
        continue
    os.unlink("/tmp/probe.req")
    if req[0] == "poke":
        f.seek(0)
        f.write(req[1].encode().ljust(4096, b"."))
        f.flush()
        out = "ok"
    else:
        out = digest()
    with open("/tmp/probe.out.tmp", "w") as o:
        o.write(out)
    os.rename("/tmp/probe.out.tmp", "/tmp/probe.out")
"""


def expected_digest(mib: int) -> str:
    h = hashlib.sha256()
    for i in range(mib):
        h.update(hashlib.sha256(b"%d" % i).digest() * (1 << 15))
    return h.hexdigest()


def start_ghost(ws: Workspace, mib: int = GHOST_MIB) -> str:
    ws.files.write("/root/ghost.py", GHOSTPROG)
    ws.commands.spawn(["python3", "/root/ghost.py", str(mib)])
    digest = wait_file(ws, "/tmp/probe.ready")
    assert ws.exec("test -e /tmp/ghost").exit_code == 1, "the file is deleted, only its descriptor holds it"
    return digest


def test_a_64_mib_deleted_open_file_is_read_back_in_every_clone(family):
    ws = family.create()
    digest = start_ghost(ws)
    assert digest == expected_digest(GHOST_MIB)
    snap = family.snapshot(ws)
    assert snap.record.image_bytes >= GHOST_MIB * MIB, "the ghost's bytes are in the snapshot's images"
    assert snap.size_bytes >= GHOST_MIB * MIB
    clones = family.restore(snap, 2) + family.fork(ws, 1)
    for c in clones:
        assert ask(c, "sum") == digest, f"{c.id} read other bytes from its deleted file"
    # each clone's copy is its own
    a, b, c = clones
    assert ask(a, "poke a") == "ok"
    assert ask(a, "sum") != digest
    assert ask(b, "sum") == digest and ask(ws, "sum") == digest
    (aa,) = family.fork(a, 1)  # a fork of a fork carries the changed copy
    assert ask(aa, "sum") == ask(a, "sum")


def test_a_ghost_above_the_limit_is_refused_naming_process_and_file(family):
    ws = family.create()
    digest = start_ghost(ws, 8)
    small = dataclasses.replace(family.cfg, ghost_limit="4M")
    with pytest.raises(NotForkable) as info:
        Workspace.get(ws.id, config=small).fork(1)
    err = info.value
    assert "/tmp/ghost" in err.message and "python3 /root/ghost.py 8" in err.message, err.message
    assert "8.0 MiB" in err.message and "ghost limit of 4.0 MiB" in err.message, err.message
    assert err.hint and "BUNSHIN_GHOST_LIMIT" in err.hint
    assert err.details["path"] == "/tmp/ghost" and err.details["size"] == 8 * MIB
    assert err.details["ghost_limit"] == 4 * MIB
    left = leftovers(family.cfg)
    assert not (left.get("snapshot_records") or left.get("snapshots") or left.get("mem")), left
    assert ask(ws, "sum") == digest, "the workspace runs on, its file intact"


def test_a_ghost_limit_that_is_no_size_is_refused_before_anything_is_dumped(family):
    ws = family.create()
    for limit in ("lots", "0", -5, "1T", True):
        with pytest.raises(InvalidArgument) as info:
            Workspace.get(ws.id, config=dataclasses.replace(family.cfg, ghost_limit=limit)).fork(1)
        assert "BUNSHIN_GHOST_LIMIT" in (info.value.hint or ""), limit
        assert not leftovers(family.cfg).get("snapshot_records"), limit
