"""The workspace layer: Workspace objects over the runtime."""

from .host import LocalHost
from .workspace import Commands, Files, Session, Snapshot, Workspace, WorkspaceInfo

__all__ = ["Commands", "Files", "LocalHost", "Session", "Snapshot", "Workspace", "WorkspaceInfo"]
