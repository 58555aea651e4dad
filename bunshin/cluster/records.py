"""What the cluster layer says about its hosts: typed records, JSON-ready."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class HostLimits:
    """The admission caps a host's ``bunshin serve`` was started with (``None``: none)."""

    max_workspaces: int | None = None
    max_memory: int | None = None  # bytes: the sum of the workspaces' memory limits
    reserve_memory: int | None = None  # bytes the host keeps for itself

    def serve_args(self) -> list[str]:
        """These caps as ``bunshin serve`` options."""
        args = ["--reserve-memory", str(self.reserve_memory) if self.reserve_memory else "off"]
        if self.max_workspaces is not None:
            args += ["--max-workspaces", str(self.max_workspaces)]
        # the scheduler counts memory only when it is given: a host it thinks uncapped is served so
        args += ["--max-memory", str(self.max_memory) if self.max_memory is not None else "off"]
        return args


@dataclass(frozen=True)
class Endpoint:
    """How the head reaches one host's server: made on the head, its token derived there
    from the cluster secret (never carried by Ray; it stays out of status reports)."""

    name: str
    url: str
    token: str = field(repr=False)


@dataclass(frozen=True)
class SignedEndpoint:
    """What a host actor says of its server (through Ray): where it listens and the epoch
    it serves, signed with the cluster secret's fencing key (``mac``), so the head sends
    a token only to a URL a host with the secret named. No token in it."""

    name: str
    url: str
    epoch: int
    mac: str


@dataclass(frozen=True)
class HostInfo:
    """One host as its actor reports it."""

    name: str  # the Ray node's ``bunshin-host-NAME`` resource, else its node id's head
    node_id: str
    url: str
    home: str
    alive: bool  # its server answers
    pid: int | None  # the server's process id on that node
    free_memory: int  # MemAvailable of the node, bytes
    total_memory: int
    load: float  # 1-minute load average per CPU of the node
    workspaces: int  # live workspaces on its server
    snapshots: list[str] = field(default_factory=list)  # ids of the snapshots it holds
    limits: HostLimits = field(default_factory=HostLimits)
    error: str | None = None  # why it does not answer
    epoch: int | None = None  # the cluster's epoch for it (bunshin.cluster.fence)
    fenced: int = 0  # times its home was emptied because the head had given it up
    rejected: int = 0  # records in Ray's key-value store its actor ignored: not signed with the cluster secret

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HostInfo:
        return cls(**{**d, "limits": HostLimits(**d.get("limits") or {})})
