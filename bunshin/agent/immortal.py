"""Making every object the agent holds when it is ready immortal (Python 3.12 and later).

In a forked clone each page the agent writes is copied from the snapshot into the
clone. A call touches thousands of long-lived objects (functions, code, constants,
modules, types) and Python writes each one's reference count, so a clone's first calls
copied some 2 MiB of the agent that they only used. From 3.12 on an object whose
reference count has its low 32 bits all set is immortal (PEP 683): ``Py_INCREF`` and
``Py_DECREF`` leave it as it is. ``make_all_immortal`` gives that count to every object
the cyclic GC tracks and to everything they refer to (strings, code, ints, ...), once,
when the agent is ready. Such objects are never freed: what the agent holds at that
point (its modules and state) it keeps for its life anyway.

Below 3.12 (no immortal objects) it does nothing.
"""

from __future__ import annotations

import ctypes
import gc
import sys

#: ``_Py_IMMORTAL_REFCNT`` of 64-bit CPython 3.12 and 3.13 (``UINT_MAX``): the low 32 bits set.
IMMORTAL_REFCNT = 0xFFFF_FFFF
SUPPORTED = sys.version_info >= (3, 12) and sys.maxsize > 2**32 and sys.implementation.name == "cpython"


def make_all_immortal() -> int:
    """Make every object reachable from the GC's lists immortal; how many were made so
    (0 where unsupported). Objects already immortal are left alone."""
    if not SUPPORTED or getattr(sys, "_is_gil_enabled", lambda: True)() is False:
        return 0  # a free-threaded build counts references another way
    # The address space as 8-byte words (nothing is allocated: a view from address 0), so a
    # count is one index away; the referents of a whole level are asked for at once.
    words = (ctypes.c_ssize_t * (1 << 44)).from_address(0)
    seen: set[int] = set()
    frontier: list[object] = [*gc.get_objects(), *sys.modules.values()]
    seen.update((id(seen), id(frontier)))  # the walk's own containers stay mortal: freed after
    count = 0
    while frontier:
        level: list[object] = []
        seen.add(id(level))
        for obj in frontier:
            key = id(obj)
            if key in seen:
                continue
            seen.add(key)
            level.append(obj)
            if words[key >> 3] & _LOW32 < _SIGN32:  # not immortal yet (static objects are)
                words[key >> 3] = IMMORTAL_REFCNT
                count += 1
        frontier.clear()
        frontier = gc.get_referents(*level)
        seen.add(id(frontier))
        level.clear()
    seen.clear()
    return count


_LOW32 = 0xFFFF_FFFF
_SIGN32 = 0x8000_0000


def release_free_memory() -> None:
    """Give the free pages malloc holds back to the kernel (glibc's ``malloc_trim``): what
    imports and the walk above freed is not kept by the agent, nor dumped with it."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
