"""bunshin: live-forkable, isolated workspaces for RL of tool-using agents."""

__version__ = "0.1.0"
