"""``bunshin.client``: workspaces on a ``bunshin serve`` host, behind the same protocols.

``Client(url, token=...)`` hands out :class:`RemoteWorkspace` and :class:`RemoteSnapshot`,
which satisfy :mod:`bunshin.workspace.protocol`: tools, the prefix cache and the
rollout engine run on them unchanged (through ``AsyncWorkspace`` where they are async).
``AsyncClient`` is the same client awaitable: its workspaces are ``AsyncWorkspace``
over remote ones. Calls refused with 429 are resent after Retry-After (``Retry``);
creates, forks, snapshots and restores carry one ``Idempotency-Key`` per call.
"""

from .aio import AsyncClient
from .client import Client, Retry
from .groups import RemoteGroup, RemoteTrajectory
from .remote import RemoteSnapshot, RemoteWorkspace

__all__ = ["AsyncClient", "Client", "RemoteGroup", "RemoteSnapshot", "RemoteTrajectory", "RemoteWorkspace",
           "Retry"]
