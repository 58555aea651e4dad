"""The in-workspace agent: PID 1 of a workspace, serving requests on a unix socket.

This package runs *inside* the workspace with the workspace's own Python copy:
standard library only, relative imports only, never ``bunshin.*``. The launcher
copies it to ``/.bunshin/agent/bunshin_agent/`` and runs
``python3.11 -I -m bunshin_agent --socket /.bunshin/run/agent.sock``. The host
side is ``bunshin.runtime.agent_host.client``; the wire format is in ``wire``.
"""

from .wire import VERSION

__all__ = ["VERSION"]
