"""Network namespaces bunshin makes have a TCP table of their own, and so do those made in them.

A namespace made from the host's shares the host's TCP table, which CRIU's socket-diag
queries walk whole in every dump; ``syscalls.new_netns`` gives each one its own small
table without changing anything of the host's.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from bunshin.runtime.criu import prepared
from bunshin.runtime.criu import run as criu
from bunshin.runtime.kernel import syscalls as sc

pytestmark = pytest.mark.integration

TABLE = Path("/proc/sys/net/ipv4/tcp_ehash_entries")  # negative: the namespace shares the host's
CHILD = Path("/proc/sys/net/ipv4/tcp_child_ehash_entries")
# what a namespace reports, and one made inside it (as CRIU makes a clone's with TCP connections)
SCRIPT = f"cat {TABLE}; unshare -n cat {TABLE}"


def _host_tables() -> tuple[str, str]:
    return TABLE.read_text().strip(), CHILD.read_text().strip()


def test_a_placement_namespace_and_one_made_inside_it_have_their_own_table():
    host = _host_tables()
    with tempfile.TemporaryFile() as out:
        ran = prepared.run(["/bin/sh", "-c", SCRIPT], criu.Placement(new_netns=True), out.fileno(), 10)
        assert ran is not None and ran[0] == 0, "the launcher did not run the script"
        out.seek(0)
        assert out.read().decode().split() == [str(sc.NETNS_TCP_BUCKETS)] * 2
    assert _host_tables() == host  # the host's own table and setting are untouched


def test_new_netns_without_the_launcher_too():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (reports through the pipe)
        try:
            sc.new_netns()
            os.write(w, TABLE.read_text().encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 64).decode().strip() == str(sc.NETNS_TCP_BUCKETS)
    finally:
        os.close(r)
        os.waitpid(pid, 0)


def test_a_clone_runs_in_a_namespace_with_its_own_table(family):
    ws = family.create()
    (clone,) = family.fork(ws)
    out = clone.exec(["cat", str(TABLE)])
    assert out.exit_code == 0 and out.stdout.strip() == str(sc.NETNS_TCP_BUCKETS)
    assert ws.exec(["cat", str(TABLE)]).stdout.strip().startswith("-")  # the first workspace: the host's
