"""The workspace layer: Workspace objects over the runtime."""

from .workspace import Commands, Files, Session, Workspace, WorkspaceInfo

__all__ = ["Commands", "Files", "Session", "Workspace", "WorkspaceInfo"]
