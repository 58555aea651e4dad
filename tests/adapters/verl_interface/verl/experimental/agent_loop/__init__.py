"""verl.experimental.agent_loop, as 0.9.1 exports it (the names the adapter uses)."""

from .agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "register"]
