"""Rollouts: groups of trajectories per task, each in its own workspace, with rewards.

- :mod:`.task`: task specs (YAML/JSON) — image, setup, tools, limits, reward command.
- :mod:`.policies`, :mod:`.openai_client`: trace replay, Python callables, an
  OpenAI-compatible chat endpoint.
- :mod:`.envs`: the modes — ``baseline`` (fresh workspace + setup per trajectory),
  ``copy`` (plain CRIU restore of the task root), ``bunshin`` (fork + cache + speculation).
- :mod:`.engine`: :class:`RolloutEngine`, :func:`rollout`; :mod:`.gym`: :class:`RolloutEnv`.
"""

from .engine import Episode, RolloutEngine, rollout, rollout_sync
from .envs import Mode, ModeOptions
from .gym import RolloutEnv
from .openai_client import OpenAIPolicy
from .policies import (
    CallablePolicy,
    Policy,
    PolicyContext,
    Trace,
    TraceReplayPolicy,
    load_traces,
    parse_traces,
)
from .records import Action, GroupResult, Status, Step, StepObservation, ToolCall, TrajectoryResult
from .task import TaskSpec, load_task, parse_task

__all__ = [
    "Action", "CallablePolicy", "Episode", "GroupResult", "Mode", "ModeOptions", "OpenAIPolicy", "Policy",
    "PolicyContext", "RolloutEngine", "RolloutEnv", "Status", "Step", "StepObservation", "TaskSpec", "ToolCall",
    "Trace", "TraceReplayPolicy", "TrajectoryResult", "load_task", "load_traces", "parse_task", "parse_traces",
    "rollout", "rollout_sync",
]
