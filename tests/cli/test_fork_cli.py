"""Integration: the fork commands of the `bunshin` command line, across invocations."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import bunshin

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_fork_snapshot_restore_tree_rm(no_leaks, tmp_path):
    cfg = no_leaks
    ws = bunshin(cfg, "create", "--memory", "256M").stdout.strip()
    made: list[str] = [ws]
    try:
        bunshin(cfg, "exec", ws, "--", "sh", "-c", "echo parent > /root/f")
        fork = json.loads(bunshin(cfg, "fork", ws, "-n", "2", "--json").stdout)
        assert fork["parent"] == ws and fork["snapshot"].startswith("snap-") and fork["mode"] == "cow"
        assert fork["pause_ms"] > 0 and fork["dump_ms"] > 0 and len(fork["forks"]) == 2 and "clones" not in fork
        assert all(c["id"].startswith("ws-") and c["restore_ms"] > 0 for c in fork["forks"])
        assert all(c["parent"] == ws and c["state"] == "running" for c in fork["forks"])  # the API's WorkspaceOut
        made += [c["id"] for c in fork["forks"]]
        for c in fork["forks"]:
            assert bunshin(cfg, "exec", c["id"], "--", "cat", "/root/f", "/run/bunshin/fork-id").stdout == \
                f"parent\n{c['id']}\n"

        snap = bunshin(cfg, "snapshot", ws).stdout.strip()  # short for `snapshot create`
        assert snap.startswith("snap-")
        restored = json.loads(bunshin(cfg, "restore", snap, "-n", "1", "--json").stdout)
        assert restored["snapshot"] == snap and len(restored["forks"]) == 1
        made += [c["id"] for c in restored["forks"]]

        tree = json.loads(bunshin(cfg, "tree", "--json").stdout)
        (root,) = tree["roots"]
        assert root["id"] == ws and root["kind"] == "workspace" and root["depth"] == 0
        kinds = {s["id"]: s for s in root["children"]}
        assert kinds[fork["snapshot"]]["keep"] is False and kinds[snap]["keep"] is True
        assert sorted(c["id"] for c in kinds[fork["snapshot"]]["children"]) == sorted(made[1:3])
        assert kinds[snap]["memfile_bytes"] > 0 and root["memory"]["anon_bytes"] > 0
        assert ws in bunshin(cfg, "tree").stdout

        saved = tmp_path / "saved"
        assert bunshin(cfg, "snapshot", "save", snap, str(saved)).stdout.strip() == str(saved)
        listed = json.loads(bunshin(cfg, "snapshot", "ls", "--json").stdout)
        assert {s["id"] for s in listed} == {fork["snapshot"], snap} and all(s["size_bytes"] > 0 for s in listed)
        assert set(bunshin(cfg, "snapshot", "ls", "-q").stdout.split()) == {fork["snapshot"], snap}

        bunshin(cfg, "rm", *made[1:])  # the fork's snapshot goes with its last clone
        assert {s["id"] for s in json.loads(bunshin(cfg, "snapshot", "ls", "--json").stdout)} == {snap}
        kept_out = json.loads(bunshin(cfg, "snapshot", "create", ws, "--json").stdout)
        assert {"id", "source", "mode", "created_at", "depth", "pause_ms", "size_bytes"} <= kept_out.keys()
        kept = kept_out["id"]
        r = bunshin(cfg, "snapshot-rm", kept)  # the old spelling: still works, says which is the way
        assert r.stdout == kept + "\n" and "deprecated" in r.stderr and "bunshin snapshot rm" in r.stderr
        assert bunshin(cfg, "snapshot", "rm", snap).stdout == snap + "\n"
        assert json.loads(bunshin(cfg, "snapshot", "ls", "--json").stdout) == []

        loaded = bunshin(cfg, "snapshot", "load", str(saved)).stdout.strip()
        assert loaded == snap
        again = json.loads(bunshin(cfg, "restore", loaded, "--json").stdout)["forks"][0]["id"]
        made.append(again)
        assert bunshin(cfg, "exec", again, "--", "cat", "/root/f").stdout == "parent\n"
        r = bunshin(cfg, "rm", again, loaded)  # `rm snap-...`: deprecated, still works
        assert r.stdout.split() == [again, loaded] and f"bunshin snapshot rm {loaded}" in r.stderr
    finally:
        for ref in made:
            bunshin(cfg, "rm", ref, check=False)
        for s in json.loads(bunshin(cfg, "snapshot", "ls", "--json").stdout):
            bunshin(cfg, "snapshot", "rm", s["id"], check=False)


@pytest.mark.parametrize("args, message", [
    (("fork", "ws-missing"), "no workspace"),
    (("restore", "snap-missing"), "no snapshot"),
    (("snapshot", "rm", "snap-missing"), "no snapshot"),
    (("snapshot", "save", "snap-missing"), "the following arguments are required: folder"),
    (("snapshot", "ws-missing"), "no workspace"),
    (("snapshot", "load", "/nonexistent"), "holds no saved snapshot"),
])
def test_fork_errors_are_clear(no_leaks, args, message):
    r = bunshin(no_leaks, *args, check=False)
    assert r.returncode == 125 and message in r.stderr and "Traceback" not in r.stderr


def test_fork_bad_count_and_mode(no_leaks):
    ws = bunshin(no_leaks, "create", "--memory", "256M").stdout.strip()
    try:
        for args, message in ((("-n", "0"), "cannot make 0 clones"), (("--mode", "lazy"), "unknown fork mode")):
            r = bunshin(no_leaks, "fork", ws, *args, check=False)
            assert r.returncode == 125 and message in r.stderr
        assert bunshin(no_leaks, "exec", ws, "--", "echo", "alive").stdout == "alive\n"
    finally:
        bunshin(no_leaks, "rm", ws)
