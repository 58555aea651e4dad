"""Integration: an open file whose name is gone but which has another link survives a fork.

CRIU links such a file back into the workspace's tree while it dumps
(``link_remap.N`` beside it), and each clone's restore opens that name in its layer.
The frozen copy of the upper is made while CRIU dumps (``upper_copy``'s early copy), so
a dump that recorded such a link is made again with the copy at CRIU's post-dump
stage: the link is in the snapshot's layer, the clone reads the file's bytes through
its descriptor, and no ``link_remap`` is left in the parent's files.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshin.runtime.snapshot import upper_copy
from tests.workspace.test_fork import wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

# /tmp/a holds the bytes, /tmp/b is a second name of it; a sleeper keeps /tmp/a open
# as fd 3 and /tmp/a goes: the file lives on under /tmp/b, its open name is gone.
SETUP = ("printf 'linked bytes\\n' > /tmp/a && ln /tmp/a /tmp/b && "
         "(exec 3</tmp/a; rm /tmp/a; exec sh -c 'echo $$ > /tmp/holder; exec sleep 1000') >/dev/null 2>&1 &")
# the holder's fd 3, read through /proc: what it points at and its bytes
READ = 'p=$(cat /tmp/holder); readlink /proc/$p/fd/3; cat /proc/$p/fd/3'


def test_a_file_open_by_a_name_that_is_gone_reads_back_in_its_clone(family, monkeypatch):
    attempts: list[bool] = []
    start_over = upper_copy.start_over

    def counted(images: Path, layer: Path) -> None:
        attempts.append(True)
        start_over(images, layer)

    monkeypatch.setattr(upper_copy, "start_over", counted)
    ws = family.create()
    assert ws.exec(["sh", "-c", SETUP]).exit_code == 0
    wait_file(ws, "/tmp/holder")
    plain = family.snapshot(ws)  # CRIU links the holder's file back: the dump is made again, late
    assert attempts == [True], "the dump that linked a file back was made again with the late copy"
    layer = Path(plain.record.layer)
    assert [p.name for p in (layer / "tmp").iterdir() if p.name.startswith("link_remap")], \
        "the snapshot's layer holds CRIU's link"
    (clone,) = family.restore(plain, 1)
    r = clone.exec(["sh", "-c", READ])
    assert r.exit_code == 0 and r.stdout.splitlines() == ["/tmp/a (deleted)", "linked bytes"], r
    assert ws.exec(["sh", "-c", "ls /tmp | grep -c link_remap"]).stdout.strip() == "0"  # CRIU removed its link
    assert clone.exec(["cat", "/tmp/b"]).stdout == "linked bytes\n"


def test_a_dump_without_such_a_file_is_made_once(family, monkeypatch):
    attempts: list[bool] = []
    monkeypatch.setattr(upper_copy, "start_over", lambda images, layer: attempts.append(True))
    ws = family.create()
    ws.files.write("/tmp/kept", "x\n")
    snap = family.snapshot(ws)
    assert attempts == [] and (Path(snap.record.layer) / "tmp" / "kept").read_text() == "x\n"
