"""Groups and trajectories on a served host: the caller's share of a rollout group.

``client.group(key=..., n=..., task=...)`` joins the group ``key`` (the first caller,
from whatever process, builds its root) and hands back :class:`RemoteGroup` with this
caller's ``n`` :class:`RemoteTrajectory` objects. Their calls go through the server's
prefix cache, which every trajectory of the key shares. Constructing these objects
does no I/O; leaving a ``with RemoteGroup`` block closes this caller's trajectories,
never the group (other processes use it): ``remove()`` frees the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..api import groups as g
from ..api import models as m
from ..rollout.task import TaskSpec
from ..tools import Observation
from .remote import Client, RemoteWorkspace

#: A task as the client takes it: a ``TaskSpec`` or its JSON form.
TaskLike = TaskSpec | Mapping[str, Any]


def join(client: Client, *, key: str, n: int = 1, image: str | None = None, snapshot: str | None = None,
         task: TaskLike | None = None, tools: Sequence[str] | None = None,
         speculation: bool = True) -> RemoteGroup:
    """``n`` new trajectories of the group ``key`` (built from exactly one of ``image``,
    ``snapshot`` or ``task`` by its first caller); see ``POST /v1/groups``."""
    task_json = task.model_dump(mode="json") if isinstance(task, TaskSpec) else (
        dict(task) if task is not None else None)
    req = m.build(g.CreateGroup, key=key, n=n, image=image, snapshot=snapshot, task=task_json,
                  tools=list(tools) if tools is not None else None, speculation=speculation)
    r = client.request("POST", "/v1/groups", json=req.model_dump(mode="json"),
                       default_wait=False)  # the first caller waits for the task's setup
    return RemoteGroup(client, g.GroupOut.model_validate(r.json()))


class RemoteGroup:
    """A group on the host and this caller's trajectories of it."""

    def __init__(self, client: Client, out: g.GroupOut) -> None:
        self._client = client
        self._out = out
        self.trajectories = [RemoteTrajectory(client, t) for t in out.trajectories]

    @property
    def key(self) -> str:
        return self._out.key

    @property
    def root(self) -> str:
        """The id of the root snapshot every trajectory of the key starts from."""
        return self._out.root

    @property
    def created(self) -> bool:
        """This caller's request built the root."""
        return self._out.created

    @property
    def info(self) -> g.GroupOut:
        """What the server said when this caller joined."""
        return self._out

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Any:
        return iter(self.trajectories)

    def __getitem__(self, i: int) -> RemoteTrajectory:
        return self.trajectories[i]

    def __repr__(self) -> str:
        return f"RemoteGroup({self.key!r}, root={self.root!r}, {len(self)} trajectories on {self._client.url})"

    def status(self) -> g.GroupOut:
        """The group now, with every open trajectory of the key (all callers')."""
        return g.GroupOut.model_validate(self._client.request("GET", f"/v1/groups/{self.key}").json())

    def close(self) -> None:
        """Close this caller's trajectories (the group stays for the others)."""
        for t in self.trajectories:
            t.close()

    def remove(self) -> None:
        """Free the group on the host: every trajectory of the key, its cache, its root."""
        self._client.request("DELETE", f"/v1/groups/{self.key}", default_wait=False)

    def __enter__(self) -> RemoteGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteTrajectory:
    """One trajectory of a group: ``call`` tools, then ``workspace``, ``reward``, ``close``."""

    def __init__(self, client: Client, out: g.TrajectoryOut) -> None:
        self._client = client
        self._out = out
        self._path = f"/v1/trajectories/{out.id}"
        self._closed = False

    @property
    def id(self) -> str:
        return self._out.id

    @property
    def key(self) -> str:
        return self._out.key

    def __repr__(self) -> str:
        return f"RemoteTrajectory({self.id!r} of {self.key!r})"

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> Observation:
        """One tool call, served from the group's cache or run in this trajectory's fork;
        bad calls come back as an observation with ``error`` set, as in-process."""
        req = m.build(g.CallRequest, name=name, arguments=dict(arguments) if isinstance(arguments, Mapping)
                      else (arguments if arguments is not None else {}))
        r = self._client.request("POST", f"{self._path}/calls", json=req.model_dump(mode="json"),
                                 default_wait=False)  # the tool's own timeout bounds it on the server
        return Observation(**g.ObservationOut.model_validate(r.json()).model_dump())

    def status(self) -> g.TrajectoryOut:
        return g.TrajectoryOut.model_validate(self._client.request("GET", self._path).json())

    def workspace(self) -> RemoteWorkspace:
        """Its workspace, brought up to date; from then on its calls run uncached there.
        It belongs to the trajectory: ``close()`` removes it."""
        r = self._client.request("GET", f"{self._path}/workspace", default_wait=False)
        return RemoteWorkspace(self._client, m.WorkspaceOut.model_validate(r.json()))

    def reward(self) -> g.RewardOut:
        """The task's reward command run in its workspace (``reward`` None without one)."""
        r = self._client.request("POST", f"{self._path}/reward", default_wait=False)
        return g.RewardOut.model_validate(r.json())

    def close(self) -> None:
        """Remove its workspace and speculations; closing twice is a no-op."""
        if self._closed:
            return
        self._client.request("DELETE", self._path)
        self._closed = True

    def __enter__(self) -> RemoteTrajectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
