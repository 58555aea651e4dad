"""This machine as a :class:`~bunshin.workspace.protocol.HostAPI`: workspaces made by the
runtime here, under one :class:`~bunshin.config.Config`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import Config
from ..runtime.state.records import Mount
from .protocol import HostAPI
from .workspace import Workspace


@dataclass(frozen=True)
class LocalHost:
    """Workspaces on this machine (``config``: its home, CRIU, limits)."""

    config: Config = field(default_factory=Config.from_env)

    def create(self, image: str = "host", *, name: str | None = None, memory: str | int | None = "2G",
               pids: int | None = 512, mounts: Sequence[Mount | str] = (), network: str = "none",
               allow: Sequence[str] = (), deny: Sequence[str] = ()) -> Workspace:
        """:meth:`Workspace.create` here; ``mounts`` (host folders) only exist on a local host."""
        return Workspace.create(image, name=name, memory=memory, pids=pids, config=self.config, mounts=mounts,
                                network=network, allow=allow, deny=deny)


def _conforms(host: LocalHost) -> HostAPI:
    """Never called: mypy checks here that the local host satisfies the protocol."""
    return host
