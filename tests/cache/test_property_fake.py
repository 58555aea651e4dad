"""Property: over random call sequences, a cached run is indistinguishable from re-execution.

Fake workspaces make this fast enough for many examples; the same property is
checked on the real runtime in ``test_integration.py``.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.speculate import SpeculationPolicy
from bunshin.testing import FakeWorld
from bunshin.tools import ToolSet
from tests.fakes import WORKDIR, fake_root, run, state_of

NAMES = st.sampled_from(["a", "b", "sub/c"])
WORDS = st.sampled_from(["x", "y", "zz"])

CALL = st.one_of(
    st.tuples(st.just("bash"), st.builds(lambda p, w: {"command": f"write {p} {w}"}, NAMES, WORDS)),
    st.tuples(st.just("bash"), st.builds(lambda p, w: {"command": f"append {p} {w}"}, NAMES, WORDS)),
    st.tuples(st.just("bash"), st.builds(lambda p: {"command": f"inc {p}"}, NAMES)),
    st.tuples(st.just("bash"), st.builds(lambda p: {"command": f"cat {p}; rm {p}"}, NAMES)),
    st.tuples(st.just("bash"), st.builds(lambda w: {"command": f"export V={w}; echo $V"}, WORDS)),
    st.tuples(st.just("bash"), st.builds(lambda d: {"command": f"cd /w/{d}; ls"}, st.sampled_from(["", "sub"]))),
    st.tuples(st.just("bash"), st.builds(lambda w: {"command": f"bg {w}"}, WORDS)),
    st.tuples(st.just("bash"), st.builds(lambda s: {"command": f"sleep {s}; echo $V"}, st.sampled_from([0.0, 0.02]))),
    st.tuples(st.just("read_file"), st.builds(lambda p: {"path": p}, NAMES)),
    st.tuples(st.just("write_file"), st.builds(lambda p, w: {"path": p, "content": w}, NAMES, WORDS)),
    st.tuples(st.just("edit"), st.builds(lambda p, a, b: {"path": p, "old_str": a, "new_str": b}, NAMES, WORDS, WORDS)),
)


@st.composite
def groups(draw):
    """Trajectories sharing a prefix and branching at different depths, over two iterations."""
    prefix = draw(st.lists(CALL, min_size=1, max_size=5))
    trajs = []
    for _ in range(draw(st.integers(2, 4))):
        cut = draw(st.integers(0, len(prefix)))
        trajs.append(prefix[:cut] + draw(st.lists(CALL, max_size=4)))
    again = draw(st.lists(st.sampled_from(range(len(trajs))), max_size=3))
    return trajs, [trajs[i] for i in again]


POLICIES = st.builds(
    lambda snap, shared, budget: CachePolicy(snapshot_min_s=snap, shared_min_replay_s=shared,
                                             memory_budget_bytes=budget),
    st.sampled_from([0.0, 0.015, 10.0]),
    st.sampled_from([0.0, 10.0]),
    st.sampled_from([1 << 30, 9000]),
)


async def cached_run(cache, root, calls, think):
    traj = cache.start(root)
    obs = []
    for name, args in calls:
        obs.append(await traj.call(name, args))
        await asyncio.sleep(think)
    ws = (await traj.workspace()).sync
    state = state_of(ws)
    await traj.close()
    return obs, state


def direct_run(root, calls):
    ts = ToolSet.default(workdir=WORKDIR)
    (ws,) = root.restore(1)
    try:
        return [ts.run_sync(ws, n, a) for n, a in calls], state_of(ws)
    finally:
        ws.remove()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups(), POLICIES, st.booleans(), st.sampled_from([0.0, 0.01]))
def test_cache_hits_are_indistinguishable_from_reexecution(group, policy, speculate, think):
    first, second = group
    world = FakeWorld(fork_s=0.002)
    root = fake_root(world)

    async def go():
        spec = SpeculationPolicy(min_expected_s=0.0, max_concurrent=3, think_aware=False) if speculate else None
        cache = PrefixCache(ToolSet.default(workdir=WORKDIR), policy=policy, speculation=spec)
        got = list(await asyncio.gather(*(cached_run(cache, root, c, think) for c in first)))
        cache.new_iteration()
        got += await asyncio.gather(*(cached_run(cache, root, c, think) for c in second))
        stats = cache.stats()
        await cache.aclose()
        return got, stats

    got, stats = run(go())
    for calls, (obs, state) in zip(first + second, got, strict=True):
        want_obs, want_state = direct_run(root, calls)
        assert [(o.output, o.exit_code, o.error) for o in obs] == [
            (o.output, o.exit_code, o.error) for o in want_obs], calls
        assert state == want_state, calls
    assert stats.divergences == 0
    assert world.leftovers(keep=[root.id]) == {}
