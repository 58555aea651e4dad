"""The prefix tree: one per task root, a node per call sequence since the root.

A node holds its call, the call's observation once known (``done`` is pending
while someone runs it), and maybe a snapshot of the state after it. A read-only
call leaves the state unchanged, so its node's *state node* is its parent's:
snapshots hang only on state nodes, and replays skip read-only calls.
A ``WsHandle`` is a live workspace and the state node it is in. Nothing here does I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from ..tools import Observation, ToolCall
from ..workspace.aio import AsyncSnapshot, AsyncWorkspace


class WsHandle:
    """A live workspace the cache drives, and the tree state (a state node) it is in.

    Calls into it go through :mod:`.handles`, one at a time (the workspace's lock);
    ``busy`` counts those queued or running.
    """

    def __init__(self, ws: AsyncWorkspace, node: Node | None) -> None:
        self.ws = ws
        self.node = node  # None: in a state no node describes (a replay diverged)
        self.busy = 0
        self.dead = False
        self.removed = False
        self.speculative = False  # held by a speculation (running, or parked at its result)
        self.bytes = 0  # its own memory, when measured

    def __repr__(self) -> str:
        return f"WsHandle({self.ws.id!r} at {self.node!r})"


class Node:
    """One call sequence since the root (the root node has no call)."""

    def __init__(self, tree: Tree, parent: Node | None, call: ToolCall | None, read_only: bool = False) -> None:
        self.tree = tree
        self.parent = parent
        self.call = call
        self.read_only = read_only
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children: dict[str, Node] = {}
        self.obs: Observation | None = None
        self.done: asyncio.Future[None] | None = None  # set while the call is running
        self.waiters = 0  # trajectories waiting on ``done``
        self.speculated = False  # the observation came from a speculation
        # state (only meaningful on state nodes)
        self.snapshot: AsyncSnapshot | None = None  # the tree's root snapshot on the root node
        self.snapshot_bytes = 0
        self.snapshot_busy = 0  # restores from it in progress: not evictable
        self.snapshot_uses = 0
        self.snapshotting = False
        self.want_snapshot = False
        self.parked: WsHandle | None = None  # an unowned workspace in this state (from a speculation)
        # traffic
        self.reached = 0  # trajectories that reached this node, ever
        self.taken_now = 0  # ... in the current iteration
        self.taken_before = 0  # ... in earlier ones
        self.epoch = tree.epoch

    def __repr__(self) -> str:
        what = self.call.key if self.call else "<root>"
        return f"Node({what[:60]!r}, depth={self.depth})"

    @property
    def state(self) -> Node:
        """The node whose workspace state equals this one's."""
        node = self
        while node.read_only and node.parent is not None:
            node = node.parent
        return node

    def path(self) -> list[Node]:
        """Root first, this node last."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def steps_from(self, ancestor: Node) -> list[Node]:
        """The state-changing nodes after ``ancestor`` down to this one, in order."""
        out: list[Node] = []
        node: Node | None = self
        while node is not None and node is not ancestor:
            if not node.read_only:
                out.append(node)
            node = node.parent
        if node is None:
            raise ValueError(f"{ancestor!r} is not an ancestor of {self!r}")
        out.reverse()
        return out

    def replay_cost(self, ancestor: Node) -> float:
        """Seconds to bring a workspace at ``ancestor`` to this node's state."""
        return sum(n.obs.duration_s for n in self.steps_from(ancestor) if n.obs is not None)

    def nearest_snapshot(self, *, above: bool = False) -> Node:
        """The deepest node on the path (strictly above this one with ``above``) holding a snapshot."""
        node = self.parent if above else self
        while node is not None:
            if node.snapshot is not None:
                return node
            node = node.parent
        return self.tree.root

    def is_ancestor_of(self, other: Node) -> bool:
        node: Node | None = other
        while node is not None:
            if node is self:
                return True
            node = node.parent
        return False

    # --- traffic --------------------------------------------------------------------

    def _fold(self) -> None:
        if self.epoch != self.tree.epoch:
            self.taken_before += self.taken_now
            self.taken_now = 0
            self.epoch = self.tree.epoch

    def reach(self) -> None:
        self._fold()
        self.reached += 1
        self.taken_now += 1

    def taken(self) -> tuple[int, int]:
        self._fold()
        return self.taken_now, self.taken_before

    def walk(self) -> Iterator[Node]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class Tree:
    """The prefix tree of one task root."""

    def __init__(self, key: str, root_snapshot: AsyncSnapshot | None) -> None:
        self.key = key
        self.epoch = 0
        self.root = Node(self, None, None)
        self.root.snapshot = root_snapshot

    def nodes(self) -> Iterator[Node]:
        return self.root.walk()
