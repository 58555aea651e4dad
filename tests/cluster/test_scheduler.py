"""The placement rule alone: locality first, then room; full hosts queue; dead hosts never."""

from __future__ import annotations

import pytest

from bunshin.cluster.scheduler import TRAJECTORY_ESTIMATE, HostLoad, choose, plan
from bunshin.errors import Unreachable

G = 1 << 30


def hosts(**over):
    base = {n: HostLoad(n, max_workspaces=4, free_memory=8 * G) for n in "abc"}
    return [HostLoad(**{**vars(h), **over.get(n, {})}) for n, h in base.items()]


def test_the_holder_first_even_when_others_have_more_room():
    hs = hosts(b={"holds_root": True, "running": 3}, c={"free_memory": 16 * G})
    c = choose(hs)
    assert (c.host, c.migrate, c.queued) == ("b", False, False)


def test_a_full_holder_moves_the_root_to_the_roomiest_host():
    hs = hosts(a={"holds_root": True, "running": 4}, b={"running": 1}, c={"running": 3})
    c = choose(hs)
    assert (c.host, c.migrate) == ("b", True)


def test_ties_go_to_free_memory_then_name():
    hs = hosts(a={"free_memory": 2 * G}, c={"free_memory": 9 * G})
    assert choose(hs).host == "c"
    assert choose(hosts()).host == "a"


def test_a_group_larger_than_one_host_spreads_and_copies_the_root_once_per_host():
    p = plan(hosts(a={"holds_root": True}), 10)
    assert p.counts == {"a": 4, "b": 4, "c": 2} and p.migrations == ["b", "c"] and p.queued == 0


def test_every_host_full_queues_on_the_holder_without_a_copy():
    p = plan(hosts(b={"holds_root": True}), 14)
    assert p.queued == 2 and sum(p.counts.values()) == 14 and p.migrations == ["a", "c"]
    c = choose(hosts(a={"running": 4}, b={"running": 4, "holds_root": True}, c={"running": 4}))
    assert (c.host, c.migrate, c.queued) == ("b", False, True)


def test_memory_caps_and_the_free_memory_floor_bound_the_slots():
    h = HostLoad("a", max_memory=2 * G, running=1)
    assert h.slots(512 << 20) == 3 and h.slots(None) is None
    low = HostLoad("a", free_memory=G, reserve_memory=G - TRAJECTORY_ESTIMATE + 1)
    assert low.slots(None) == 0
    hs = [HostLoad("a", holds_root=True, free_memory=G, reserve_memory=G), HostLoad("b", free_memory=4 * G)]
    assert choose(hs).host == "b"


def test_dead_hosts_are_never_chosen():
    hs = hosts(a={"alive": False, "holds_root": True}, b={"alive": False})
    c = choose(hs)
    assert (c.host, c.migrate) == ("c", True)
    with pytest.raises(Unreachable, match="no live host") as e:
        choose(hosts(a={"alive": False}, b={"alive": False}, c={"alive": False}))
    assert "cluster up" in e.value.hint


def test_baseline_needs_no_root_and_makes_no_migration():
    p = plan(hosts(), 6, needs_root=False)
    assert p.migrations == [] and p.counts == {"a": 2, "b": 2, "c": 2}


def test_a_tie_on_room_goes_to_a_host_holding_the_image_before_free_memory():
    # a is the full holder; b and c have the same room: c holds the task's image, b more memory
    hs = hosts(a={"holds_root": True, "running": 4}, b={"free_memory": 16 * G}, c={"holds_image": True})
    c = choose(hs)
    assert (c.host, c.migrate) == ("c", True), "no image to move to c"
    # room still comes first: a roomier host without the image wins
    assert choose(hosts(a={"holds_root": True, "running": 4}, c={"holds_image": True, "running": 2})).host == "b"
    # and so in baseline mode
    assert choose(hosts(c={"holds_image": True}), needs_root=False).host == "c"
