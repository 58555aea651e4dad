"""``bunshin.client``: workspaces on a ``bunshin serve`` host, behind the same protocols.

``Client(url, token=...)`` hands out :class:`RemoteWorkspace` and :class:`RemoteSnapshot`,
which satisfy :mod:`bunshin.workspace.protocol`: tools, the prefix cache and the
rollout engine run on them unchanged (through ``AsyncWorkspace`` where they are async).
"""

from .client import Client
from .remote import RemoteSnapshot, RemoteWorkspace

__all__ = ["Client", "RemoteSnapshot", "RemoteWorkspace"]
