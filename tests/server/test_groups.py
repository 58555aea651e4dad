"""Groups and trajectories over real loopback HTTP: one root and one prefix cache per key.

Several processes joining one key get one root and trajectories of their own; a call
one trajectory made is the next one's hit; a task's setup runs once; rewards, closing,
freeing a group, bad input, and a server restart that finds the root again.
"""

from __future__ import annotations

import json
import multiprocessing

import httpx
import pytest

from bunshin import InvalidArgument, NotFound, SnapshotNotFound, StateConflict
from bunshin.client import Client
from bunshin.rollout.task import TaskSpec
from bunshin.server.thread import serve_in_thread

from ..conftest import leftovers
from .conftest import TOKEN

pytestmark = [pytest.mark.integration, pytest.mark.criu]

COUNT_SETUP = TaskSpec(id="count", workdir="/tmp", setup=("echo once >> /tmp/setup.log",),
                       files={"/tmp/score.sh": "cat /tmp/answer 2>/dev/null || echo none\n"},
                       reward="sh /tmp/score.sh")


_barrier = None


def _set_barrier(barrier) -> None:
    global _barrier
    _barrier = barrier


def _join_and_fork(url: str, key: str, n: int) -> dict:
    """In another process: join ``key`` when the others do, make each trajectory a workspace."""
    with Client(url, token=TOKEN) as c:
        c.health()
        _barrier.wait(60)  # every process connected: the joins race
        grp = c.group(key=key, n=n, image="host")
        out = {"root": grp.root, "created": grp.created, "trajectories": [], "workspaces": []}
        for t in grp:
            obs = t.call("bash", {"command": "echo $(( 6 * 7 ))"})
            assert obs.output.strip() == "42", obs
            out["trajectories"].append(t.id)
            out["workspaces"].append(t.workspace().id)
        grp.close()
        return out


def test_one_key_from_several_processes_gives_one_root_and_distinct_forks(served):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3, initializer=_set_barrier, initargs=(ctx.Barrier(3),)) as pool:
        outs = pool.starmap(_join_and_fork, [(served.url, "many", 2)] * 3)
    try:
        assert len({o["root"] for o in outs}) == 1
        assert sum(o["created"] for o in outs) == 1  # one builder; the others waited for its root
        trajs = [t for o in outs for t in o["trajectories"]]
        wss = [w for o in outs for w in o["workspaces"]]
        assert len(set(trajs)) == 6 and len(set(wss)) == 6
        with served.client() as c:
            assert c.list() == []  # every caller closed its trajectories: their forks are gone
    finally:
        with served.client() as c:
            c.request("DELETE", "/v1/groups/many")


def test_calls_go_through_the_one_cache_of_the_key(served):
    with served.client() as c1, served.client() as c2:
        a = c1.group(key="shared", n=2, image="host", tools=["bash", "read_file"])
        try:
            assert a.created and a.info.tools == ["bash", "read_file"] and len(a) == 2
            assert a.info.speculation  # on by default
            cmd = {"command": "echo hi > /tmp/f; cat /tmp/f"}
            first = a[0].call("bash", cmd)
            assert (first.output, first.exit_code, first.cached) == ("hi\n", 0, False)
            again = a[1].call("bash", cmd)
            assert again.cached and again.output == "hi\n"
            b = c2.group(key="shared", n=1, image="host", tools=["bash", "read_file"])
            assert not b.created and b.root == a.root
            other = b[0].call("bash", json.dumps(cmd))  # another caller, the same cache; JSON text too
            assert other.cached and other.output == "hi\n"
            assert "hi" in b[0].call("read_file", {"path": "/tmp/f"}).output
            assert {t.id for t in a} | {t.id for t in b} == {t.id for t in a.status().trajectories}
            bad = a[0].call("write_file", {"path": "/tmp/x", "content": "no"})  # not a tool of the group
            assert bad.error and not bad.cached
            ws = a[0].workspace()  # materialised, usable through the workspace routes
            assert ws.exec("cat /tmp/f", timeout=30).stdout == "hi\n"
            assert a[0].status().workspace == ws.id
            a[0].close()
            a[0].close()  # twice: a no-op
            with pytest.raises(NotFound):
                c1.get(ws.id).exec("true")
            assert b[0].reward().status == "none"  # an image group has no reward command
            b.close()
        finally:
            a.remove()
        with pytest.raises(NotFound):
            a[1].call("bash", cmd)  # the group's trajectories went with it
        assert c1.list() == []


def test_a_task_group_runs_its_setup_once_and_scores_each_trajectory(served):
    with served.client() as c1, served.client() as c2:
        g1 = c1.group(key="task-1", n=2, task=COUNT_SETUP)
        try:
            g2 = c2.group(key="task-1", n=1, task=COUNT_SETUP.model_dump(mode="json"))
            assert g1.created and not g2.created and g1.root == g2.root and g1.info.task == "count"
            trajs = [*g1, *g2]
            for t, answer in zip(trajs, ["1", "0.5", None], strict=True):
                if answer is not None:
                    obs = t.call("write_file", {"path": "answer", "content": answer + "\n"})
                    assert obs.ok, obs
            for t in trajs:  # each trajectory's workspace saw the setup run once, in the root
                assert t.workspace().files.read("/tmp/setup.log") == b"once\n"
            rewards = [t.reward() for t in trajs]
            assert [r.reward for r in rewards] == [1.0, 0.5, None]
            assert rewards[0].status == "ok" and rewards[0].exit_code == 0
            assert rewards[2].status == "error" and "no number" in (rewards[2].error or "")
            g1.close()
            g2.close()
        finally:
            g1.remove()
        with pytest.raises(NotFound):
            g1.status()


def test_a_snapshot_group_leaves_the_callers_snapshot(served):
    with served.client() as c:
        ws = c.create(memory="1G")
        try:
            ws.files.write("/tmp/seed", b"7\n")
            snap = ws.snapshot()
        finally:
            ws.remove()
        grp = c.group(key="from-snap", n=1, snapshot=snap.id)
        try:
            assert grp.root == snap.id
            assert grp[0].call("bash", {"command": "cat /tmp/seed"}).output == "7\n"
        finally:
            grp.remove()
        assert c.snapshot(snap.id).id == snap.id  # the caller's, still there
        snap.remove()


def test_a_snapshot_with_its_task_skips_the_setup_and_keeps_the_reward(served):
    """A root copied from another host comes with the task it roots: its setup is not run
    again, its reward still scores the trajectories."""
    with served.client() as c:
        first = c.group(key="built-here", n=1, task=COUNT_SETUP)
        try:
            copy = c.group(key="copied-root", n=1, snapshot=first.root, task=COUNT_SETUP)
            try:
                assert copy.root == first.root and copy.info.task == "count"
                (t,) = copy.trajectories
                assert t.workspace().files.read("/tmp/setup.log") == b"once\n"  # no second setup
                assert t.call("write_file", {"path": "answer", "content": "1\n"}).ok
                assert t.reward().reward == 1.0
            finally:
                copy.remove()
            assert c.snapshot(first.root).id == first.root  # the copy's group did not own it
        finally:
            first.remove()


def test_bad_input_answers_bunshin_errors(served):
    auth = {"Authorization": f"Bearer {served.token}"}
    url = served.url
    r = httpx.get(f"{url}/v1/groups/nope", headers=auth)
    assert r.status_code == 404 and r.json()["code"] == "not_found" and r.json()["details"] == {"key": "nope"}
    r = httpx.post(f"{url}/v1/trajectories/tr-nope/calls", json={"name": "bash"}, headers=auth)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    for path in ("/v1/trajectories/tr-nope/workspace",):
        assert httpx.get(f"{url}{path}", headers=auth).status_code == 404
    assert httpx.delete(f"{url}/v1/trajectories/tr-nope", headers=auth).status_code == 404
    assert httpx.delete(f"{url}/v1/groups/nope", headers=auth).status_code == 404
    for body in ({"key": "k", "n": 0, "image": "host"}, {"key": "k", "n": 100000, "image": "host"},
                 {"key": "k", "n": 1}, {"key": "k", "n": 1, "image": "host", "snapshot": "snap-x"},
                 {"key": "a/b", "n": 1, "image": "host"}, {"key": "k", "n": 1, "image": "/etc"}):
        r = httpx.post(f"{url}/v1/groups", json=body, headers=auth)
        assert r.status_code == 422 and r.json()["code"] == "invalid_argument", (body, r.text)
    with served.client() as c:
        with pytest.raises(InvalidArgument, match="n"):
            c.group(key="k", n=0, image="host")
        with pytest.raises(InvalidArgument, match="tools"):
            c.group(key="k", image="host", tools=["bash", "rm_rf"])
        with pytest.raises(InvalidArgument, match="max_turns"):
            c.group(key="k", task={"id": "t", "max_turns": 0})
        with pytest.raises(InvalidArgument, match="mounts"):
            c.group(key="k", task={"id": "t", "mounts": ["/etc:/host-etc"]})
        with pytest.raises(SnapshotNotFound):
            c.group(key="k", snapshot="snap-nope")
        with pytest.raises(NotFound):
            c.request("GET", "/v1/groups/k")  # nothing half-made by the refused calls
        grp = c.group(key="k", image="host")
        try:
            with pytest.raises(StateConflict, match="another root"):
                c.group(key="k", image="host", tools=["bash"])
        finally:
            grp.remove()


def test_shutdown_closes_every_group_and_a_restart_finds_the_root(no_leaks):
    cfg = no_leaks
    with serve_in_thread(cfg, TOKEN) as url, Client(url, token=TOKEN) as c:
        grp = c.group(key="durable", n=2, task=COUNT_SETUP)
        assert grp[0].call("bash", {"command": "echo 1 > /tmp/answer"}).ok  # a miss: a fork runs it
        assert grp[0].status().workspace is not None
        root = grp.root
    left = leftovers(cfg)
    assert "records" not in left  # the server's shutdown removed every trajectory's workspace
    assert root in left.get("snapshot_records", [])  # the root stays for the next start
    with serve_in_thread(cfg, TOKEN) as url, Client(url, token=TOKEN) as c:
        again = c.group(key="durable", n=1, task=COUNT_SETUP)
        assert not again.created and again.root == root
        t = again[0]
        assert t.workspace().files.read("/tmp/setup.log") == b"once\n"
        assert t.reward().reward is None  # no answer written in this one
        again.remove()
        with pytest.raises(NotFound):
            again.status()
