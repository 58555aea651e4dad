"""The workspace layer: Workspace objects over the runtime."""

from .workspace import Commands, Files, Session, Snapshot, Workspace, WorkspaceInfo

__all__ = ["Commands", "Files", "Session", "Snapshot", "Workspace", "WorkspaceInfo"]
