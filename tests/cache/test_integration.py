"""The prefix cache on the real runtime: hits are indistinguishable from re-execution."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.errors import NotFound
from bunshin.speculate import SpeculationPolicy
from bunshin.tools import ToolSet
from bunshin.workspace import Snapshot
from bunshin.workspace.protocol import SnapshotAPI
from tests.cache.conftest import TASK_DIR

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def tools() -> ToolSet:
    return ToolSet.default(workdir=TASK_DIR)


def bash(cmd: str) -> tuple[str, dict]:
    return "bash", {"command": cmd}


def state_of(ws) -> dict:
    """Files under the task folder (paths, modes, contents), shell state, processes, interpreter."""
    files = ws.exec(
        f"cd {TASK_DIR} && find . -printf '%p %m %y\\n' | sort && find . -type f -exec sha256sum {{}} + | sort",
        timeout=30,
    ).stdout
    sid = ws.sessions.list()[0].session_id
    shell = ws.sessions.run(sid, 'echo "$PWD|$V|$N"; jobs', timeout=30).output
    procs = sorted(" ".join(p.cmdline) for p in ws.processes() if p.pid != 1)
    py = tools().run_sync(ws, "python", {"code": "globals().get('n')"}).output
    return {"files": files, "shell": shell, "procs": procs, "python": py}


def direct(root: SnapshotAPI, calls) -> tuple[list, dict]:
    """The calls without a cache: a fresh fork of the root, every call run."""
    ts = tools()
    (ws,) = root.restore(1)
    try:
        return [ts.run_sync(ws, n, a) for n, a in calls], state_of(ws)
    finally:
        ws.remove()


async def cached(cache: PrefixCache, root: SnapshotAPI, calls, think: float = 0.0) -> tuple[list, dict]:
    traj = cache.start(root)
    try:
        obs = []
        for name, args in calls:
            obs.append(await traj.call(name, args))
            await asyncio.sleep(think)
        ws = (await traj.workspace()).sync
        return obs, await asyncio.to_thread(state_of, ws)
    finally:
        await traj.close()


def results(obs) -> list:
    return [(o.output, o.exit_code, o.error, o.timed_out) for o in obs]


PATHS = st.sampled_from(["a.txt", "sub/b.txt"])
WORDS = st.sampled_from(["x", "y"])
CALL = st.one_of(
    st.builds(lambda p, w: ("write_file", {"path": p, "content": f"{w}\n"}), PATHS, WORDS),
    st.builds(lambda p, a, b: ("edit", {"path": p, "old_str": a, "new_str": b}), PATHS, WORDS, WORDS),
    st.builds(lambda p: ("read_file", {"path": p}), PATHS),
    st.builds(lambda w, p: bash(f"echo {w} >> {p}; cat {p}"), WORDS, PATHS),
    st.builds(lambda p: bash(f"rm -f {p}; ls -R"), PATHS),
    st.sampled_from([
        bash("mkdir -p sub && cd sub && pwd"),
        bash(f"cd {TASK_DIR}"),
        bash("export V=$V.v; echo $V"),
        bash("N=$((N+1)); echo $N"),
        bash("sleep 1000 & jobs"),
        bash("sleep 0.3; echo slow"),
        ("python", {"code": "n = globals().get('n', 0) + 1\nn"}),
        ("python", {"code": "import os\nsorted(os.listdir('.'))"}),
    ]),
)


@st.composite
def groups(draw):
    prefix = draw(st.lists(CALL, min_size=1, max_size=4))
    return [prefix[: draw(st.integers(0, len(prefix)))] + draw(st.lists(CALL, max_size=3))
            for _ in range(draw(st.integers(2, 3)))]


def test_property_cached_paths_match_reexecution(any_root):
    """Random groups of call sequences (files, shell state, a background process, the
    interpreter): with the cache (and speculation) and without, same outputs, same end state."""
    root = any_root.snapshot

    @settings(max_examples=8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(groups(), st.sampled_from([0.0, 0.25, 10.0]), st.booleans())
    def check(group, snap_min, speculate):
        async def go():
            spec = SpeculationPolicy(min_expected_s=0.0, think_aware=False) if speculate else None
            cache = PrefixCache(tools(), policy=CachePolicy(snapshot_min_s=snap_min, shared_min_replay_s=0.0),
                                speculation=spec)
            try:
                first = await asyncio.gather(*(cached(cache, root, c, 0.05) for c in group))
                second = await asyncio.gather(*(cached(cache, root, c) for c in group))  # all hits now
                return first, second, cache.stats()
            finally:
                await cache.aclose()

        first, second, stats = asyncio.run(go())
        for calls, (obs1, state1), (obs2, state2) in zip(group, first, second, strict=True):
            want_obs, want_state = direct(root, calls)
            assert results(obs1) == results(want_obs), calls
            assert results(obs2) == results(want_obs), calls
            assert state1 == want_state, calls
            assert state2 == want_state, calls
            assert all(o.cached for o in obs2)
        assert stats.divergences == 0

    check()


def test_miss_materialises_from_the_snapshot_after_a_slow_call(any_root):
    root = any_root.snapshot
    prefix = [bash("export V=1; echo one > a.txt"), bash("sleep 0.6; echo two >> a.txt"), bash("cd sub 2>/dev/null; pwd")]

    async def go():
        cache = PrefixCache(tools(), policy=CachePolicy(snapshot_min_s=0.5))
        try:
            await cached(cache, root, prefix)
            assert cache.stats().snapshots == 1
            traj = cache.start(root)
            for call in prefix:
                assert (await traj.call(*call)).cached
            assert traj.handle is None  # virtual so far
            obs = await traj.call(*bash("cat a.txt; echo $V"))
            assert obs.output == "one\ntwo\n1\n" and not obs.cached
            assert traj.stats.materialisations == 1 and traj.stats.replayed == 1  # only the "cd"
            await traj.close()
        finally:
            await cache.aclose()

    asyncio.run(go())


def test_save_and_load_across_caches(real_root, tmp_path):
    """Saved with its snapshots, the tree outlives its cache (and the snapshots' removal)."""
    root = real_root.snapshot
    calls = [("python", {"code": "big = 'x' * 10\nlen(big)"}), bash("sleep 0.6; export K=kept")]

    async def go():
        cache = PrefixCache(tools(), policy=CachePolicy(snapshot_min_s=0.5))
        await cached(cache, root, calls)
        (node_snap,) = [n.snapshot for t in cache.engine.trees.values() for n in t.nodes() if n.parent and n.snapshot]
        cache.save(tmp_path)
        assert (tmp_path / "tree.json").is_file() and (tmp_path / "snapshots" / node_snap.id).is_dir()
        await cache.aclose()  # removes the cache's snapshots from the store
        with pytest.raises(NotFound):
            Snapshot.get(node_snap.id, config=real_root.cfg)

        loaded = PrefixCache.load(tmp_path, tools(), config=real_root.cfg)  # brings it back from the folder
        try:
            assert loaded.roots()[root.id].id == root.id
            traj = loaded.start(root)
            assert all([(await traj.call(*c)).cached for c in calls])
            obs = await traj.call(*bash("echo $K"))
            py = await traj.call("python", {"code": "big"})
            assert (obs.output, py.output) == ("kept\n", "'xxxxxxxxxx'\n")
            assert traj.stats.replayed == 0  # straight from the loaded snapshot
            await traj.close()
        finally:
            await loaded.aclose()

    asyncio.run(go())


def test_eviction_under_a_memory_budget(any_root):
    root = any_root.snapshot

    async def go():
        cache = PrefixCache(tools(), policy=CachePolicy(snapshot_min_s=0.0, memory_budget_bytes=1))
        try:
            for i in range(2):
                await cached(cache, root, [bash(f"echo {i} > f.txt"), bash("cat f.txt")])
            await asyncio.sleep(0.5)
            st = cache.stats()
            assert st.evictions >= 2 and st.bytes_held <= 1 and st.snapshots == 0
            obs, state = await cached(cache, root, [bash("echo 1 > f.txt"), bash("cat f.txt"), bash("cat f.txt; pwd")])
            assert obs[2].output == f"1\n{TASK_DIR}\n"
        finally:
            await cache.aclose()

    asyncio.run(go())


def test_invalid_arguments_are_tool_errors(real_root):
    root = real_root.snapshot

    async def go():
        cache = PrefixCache(tools())
        try:
            traj = cache.start(root)
            bad = [await traj.call("edit", {"path": "README"}), await traj.call("bash", {"cmd": "ls"}),
                   await traj.call("read_file", '{"path": '), await traj.call("nope", {})]
            assert all(o.error and o.exit_code is None for o in bad)
            edit = await traj.call("edit", {"path": "README", "old_str": "nothere", "new_str": "x"})
            assert "not found" in edit.error
            ok = await traj.call("read_file", {"path": "README"})
            assert ok.output == "hello\n" and ok.error is None
            await traj.close()
        finally:
            await cache.aclose()

    asyncio.run(go())
