"""verl: an agent loop registered as ``bunshin_agent`` and a ``BaseTool``, their tools run in bunshin workspaces.

::

    import bunshin.adapters.verl        # registers the agent loop "bunshin_agent"
    # data: agent_name="bunshin_agent", extra_info={"task": task_json}  (or "task_file")
    # config: actor_rollout_ref.rollout.mode=async, actor_rollout_ref.rollout.n=8

verl repeats each prompt ``rollout.n`` times under one ``uid`` (its GRPO group) and runs
every sample's agent loop on an ``AgentLoopWorker`` (one Ray actor each). The agent loop
:class:`BunshinAgentLoop` keys its workspace on that ``uid``: the first sample of a uid
builds the root (a workspace, the task's setup, a copy-on-write snapshot), every sample
of the uid forks from it. In one worker the process keeps the root and frees it when the
uid's ``n`` samples are done; with ``url`` (or ``BUNSHIN_URL``) the server's group key
``uid`` joins the samples of one uid that verl put on different workers. The loop:
generate tokens with ``server_manager.generate``, parse ``<tool_call>`` blocks, run them
in the fork, append the results as tool turns (``response_mask`` 0), until no call, the
task's ``max_turns`` or ``rollout.response_length``; ``reward_score`` is the task's
reward command in the final workspace.

For verl's stock ``tool_agent`` loop, which creates and releases a tool on every call,
:class:`BunshinTool` keeps its workspace per request id (``agent_data.request_id``, one
per trajectory), forked from the task's root (``create_kwargs``: ``task`` / ``task_file``,
``instance_id``); ``calc_reward`` runs the task's reward command, ``finish`` closes it.

Options (the agent-loop config file's entry, passed by verl's hydra instantiate, or the
tool's config): ``url``, ``token``, ``token_file``, ``mode`` (``bunshin``; ``baseline``:
a fresh workspace and setup per sample), ``max_turns``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from ..client import Client
from ..config import Config
from ..errors import InvalidArgument, StateConflict
from ..rollout import Mode, ModeOptions, TaskSpec
from ..rollout.engine import default_tools, tool_schemas
from ..rollout.envs import TaskEnv, make_env
from ..rollout.records import new_id
from .trajectories import (
    LOOP,
    LocalTrajectory,
    ServedTrajectory,
    Trajectory,
    as_task,
    client,
    engine,
    open_trajectory,
    parse_calls,
    row_task,
    safe_id,
)

log = logging.getLogger("bunshin.adapters")
AGENT_NAME = "bunshin_agent"


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    """A key of a dict, an omegaconf ``DictConfig``, an object or ``None``."""
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    return getter(name, default) if getter is not None else getattr(cfg, name, default)


def task_of(sample: Mapping[str, Any]) -> TaskSpec:
    """The task of a verl sample: ``extra_info.task`` / ``extra_info.task_file`` (else the
    same keys at the top level); a dataset row may not reach into the host (see ``row_task``)."""
    info = sample.get("extra_info")
    if isinstance(info, Mapping) and (info.get("task") is not None or info.get("task_file")):
        return row_task(info, where="the sample's extra_info")
    return row_task(sample, where="the verl sample (extra_info)")


# --- one root per uid in this process -------------------------------------------------------


@dataclass
class _Uid:
    key: str
    n: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    env: TaskEnv | None = None
    opened: int = 0
    closed: int = 0


class UidRoots:
    """The roots of the uids this process serves: built by a uid's first sample, freed when
    its ``n`` samples are closed (a uid that verl split across workers never reaches ``n``
    here: the oldest such idle roots are freed beyond ``max_idle``)."""

    def __init__(self, max_idle: int = 16) -> None:
        self._guard = threading.Lock()
        self._uids: OrderedDict[str, _Uid] = OrderedDict()
        self.max_idle = max_idle

    def open(self, key: str, task: TaskSpec, *, n: int, mode: Mode | str, config: Config | None,
             options: ModeOptions | None) -> LocalTrajectory:
        """A fork of the uid's root (built on first use); blocking: call it from a thread."""
        with self._guard:
            grp = self._uids.get(key)
            if grp is None:
                grp = self._uids[key] = _Uid(key, max(1, n))
            index = grp.opened
            grp.opened += 1
        eng = engine(mode, config=config, options=options)
        try:
            with grp.lock:
                if grp.env is None:
                    env = make_env(eng.mode, as_task(task, task_id=key), eng.tools, eng.config, eng.options)
                    LOOP.run(env.prepare())
                    grp.env = env
                env = grp.env
            ep = eng.episode(env, index, new_id(key))
            LOOP.run(ep.open())
        except BaseException:
            self.closed(key)
            raise
        self._evict_idle()
        return LocalTrajectory(ep)

    def closed(self, key: str) -> None:
        """One sample of ``key`` is done; the root goes with the uid's last sample."""
        with self._guard:
            grp = self._uids.get(key)
            if grp is None:
                return
            grp.closed += 1
            done = grp.closed >= grp.n
            if done:
                del self._uids[key]
        if done:
            self._free(grp)

    def keys(self) -> list[str]:
        with self._guard:
            return list(self._uids)

    def release_all(self) -> None:
        with self._guard:
            groups, self._uids = list(self._uids.values()), OrderedDict()
        for grp in groups:
            self._free(grp)

    def _evict_idle(self) -> None:
        with self._guard:
            idle = [g for g in self._uids.values() if g.opened == g.closed]
            drop = idle[:max(0, len(idle) - self.max_idle)]
            for g in drop:
                del self._uids[g.key]
        for g in drop:
            self._free(g)

    @staticmethod
    def _free(grp: _Uid) -> None:
        with grp.lock:
            env, grp.env = grp.env, None
        if env is not None:
            try:
                LOOP.run(env.aclose())
            except Exception as e:  # the process may be going; `bunshin ls` shows what is left
                log.warning("freeing the root of uid %r failed: %s", grp.key, e)


#: This process's uid roots (the agent loop's local groups).
ROOTS = UidRoots()
_at_thread_exit = getattr(threading, "_register_atexit", None)
if _at_thread_exit is not None:  # before the thread pools stop (see trajectories.close_all)
    _at_thread_exit(ROOTS.release_all)


class _Served:
    """Per process: how many samples of each served uid closed here (the group is removed
    from the host when all ``n`` of them ran in this process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._closed: dict[str, int] = {}

    def closed(self, c: Client, key: str, n: int) -> None:
        with self._lock:
            count = self._closed[key] = self._closed.get(key, 0) + 1
            done = count >= n
            if done:
                del self._closed[key]
        if done:
            try:
                c.request("DELETE", f"/v1/groups/{key}")
            except Exception as e:  # the host keeps it; DELETE /v1/groups/{key} later
                log.warning("removing served group %r failed: %s", key, e)


_SERVED = _Served()


# --- the agent loop --------------------------------------------------------------------------


@register(AGENT_NAME)
class BunshinAgentLoop(AgentLoopBase):
    """One verl sample: a fork of its uid's root, tool calls parsed from the generated text."""

    def __init__(self, *args: Any, url: str | None = None, token: str | None = None,
                 token_file: str | None = None, mode: str = Mode.BUNSHIN.value, max_turns: int | None = None,
                 config: Config | None = None, options: ModeOptions | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.url = url or os.environ.get("BUNSHIN_URL")
        self._token, self._token_file = token, token_file
        self.mode = mode
        self.max_turns = max_turns
        self._bunshin_config = config if isinstance(config, Config) else None
        self._options = options
        self.n = int(_get(self.rollout_config, "n", 1) or 1)
        self.response_length = int(_get(self.rollout_config, "response_length", 1024) or 1024)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = task_of(kwargs)
        uid = kwargs.get("uid")
        key = safe_id(str(uid)) if uid is not None and str(uid) else task.id
        max_turns = int(self.max_turns or task.max_turns)
        raw = kwargs.get("raw_prompt")  # a list, or a numpy object array when verl's batch made it 2-D
        messages = [dict(m) for m in raw] if raw is not None and len(raw) else task.initial_messages()
        schemas = tool_schemas(default_tools(), task)
        traj, close = await asyncio.to_thread(self._open, task, key)
        t_gen = t_tools = 0.0
        calls = cached = turns = 0
        reward: float | None = None
        reward_error: str | None = None
        try:
            prompt_ids = await asyncio.to_thread(self._encode_chat, messages, schemas)
            response_ids: list[int] = []
            mask: list[int] = []
            logprobs: list[float] = []
            request_id = new_id("req")
            while True:
                t0 = time.perf_counter()
                out = await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids + response_ids,
                                                         sampling_params=sampling_params)
                t_gen += time.perf_counter() - t0
                ids = list(out.token_ids)
                response_ids += ids
                mask += [1] * len(ids)
                lp = getattr(out, "log_probs", None)
                logprobs += list(lp) if lp else [0.0] * len(ids)
                turns += 1
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
                try:
                    parsed = parse_calls(text)
                    results = []
                except InvalidArgument as e:
                    parsed, results = [], [f"error: {e}"]
                if not parsed and not results:
                    break
                if turns >= max_turns or len(response_ids) >= self.response_length:
                    break
                t0 = time.perf_counter()
                for call in parsed:
                    obs = await asyncio.to_thread(traj.call, call.name, call.arguments)
                    calls += 1
                    cached += bool(obs.cached)
                    results.append(obs.text())
                t_tools += time.perf_counter() - t0
                tool_msgs = [{"role": "tool", "content": r} for r in results]
                messages += tool_msgs
                obs_ids = await asyncio.to_thread(self._encode_turn, tool_msgs)
                response_ids += obs_ids
                mask += [0] * len(obs_ids)
                logprobs += [0.0] * len(obs_ids)
                if len(response_ids) >= self.response_length:
                    break
            try:
                reward = await asyncio.to_thread(traj.reward)
            except Exception as e:  # the sample still counts; the trainer sees why it scored 0
                reward_error = str(e)
        finally:
            await asyncio.to_thread(close)
        cut = self.response_length
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=response_ids[:cut], response_mask=mask[:cut],
            response_logprobs=logprobs[:cut] if sampling_params.get("logprobs") else None,
            reward_score=float(reward or 0.0), num_turns=len(messages),
            metrics=AgentLoopMetrics(generate_sequences=t_gen, tool_calls=t_tools),
            extra_fields={"bunshin_group": key, "bunshin_trajectory": traj.id, "tool_calls": calls,
                          "cached_calls": cached, "reward_error": reward_error})

    # --- private --------------------------------------------------------------------------

    def _open(self, task: TaskSpec, key: str) -> tuple[Trajectory, Any]:
        """The sample's fork and how to close it (blocking)."""
        if self.url:
            c = client(self.url, token=self._token, token_file=self._token_file)
            served = ServedTrajectory.open(c, task, key=key)

            def close_served() -> None:
                try:
                    served.close()
                finally:
                    _SERVED.closed(c, key, self.n)

            return served, close_served
        local = ROOTS.open(key, task, n=self.n, mode=self.mode, config=self._bunshin_config,
                           options=self._options)

        def close_local() -> None:
            try:
                local.close()
            finally:
                ROOTS.closed(key)

        return local, close_local

    def _template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                  generation: bool = True) -> str:
        kw = dict(self.apply_chat_template_kwargs or {})
        return str(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                      tokenize=False, **kw))

    def _encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        return list(self.tokenizer.encode(self._template(messages, tools=tools), add_special_tokens=False))

    def _encode_turn(self, tool_msgs: list[dict[str, Any]]) -> list[int]:
        """The tokens the chat template puts after an assistant turn for these tool results
        (the template rendered with and without them; the difference is this turn)."""
        head = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        before = self._template(head, generation=False)
        after = self._template(head + tool_msgs)
        if after.startswith(before):
            text = after[len(before):]
        else:  # a template that re-renders earlier turns: the results as plain tool-response blocks
            text = "".join(f"<tool_response>\n{m['content']}\n</tool_response>\n" for m in tool_msgs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


# --- the tool, for verl's stock tool loop ----------------------------------------------------


class BunshinTool(BaseTool):
    """One bunshin tool (``config.name``: bash, read_file, write_file, edit, python) whose calls
    run in a workspace per request id, forked from the task's root."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        config = dict(config or {})
        name = str(config.get("name") or (tool_schema.function.name if tool_schema else "bash"))
        by_name = {s["function"]["name"]: s for s in default_tools().openai_tools()}
        if name not in by_name:
            raise InvalidArgument(f"verl tool: unknown bunshin tool {name!r}",
                                  hint=f"set config.name to one of: {', '.join(sorted(by_name))}")
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(by_name[name]))
        self.tool = name
        self._url = config.get("url") or os.environ.get("BUNSHIN_URL")
        self._token, self._token_file = config.get("token"), config.get("token_file")
        self._mode = str(config.get("mode", Mode.BUNSHIN.value))
        bc = config.get("bunshin_config")
        self._bunshin_config = bc if isinstance(bc, Config) else None
        self._max_open = int(config.get("max_open", 256))
        self._lock = threading.Lock()
        self._created: dict[str, dict[str, Any]] = {}
        self._open: OrderedDict[str, Trajectory] = OrderedDict()

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        iid = instance_id or new_id("tool")
        with self._lock:
            self._created[iid] = dict(kwargs.get("create_kwargs") or {})
        return iid, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        traj = await asyncio.to_thread(self._trajectory, instance_id, kwargs)
        obs = await asyncio.to_thread(traj.call, self.tool, dict(parameters or {}))
        return ToolResponse(text=obs.text()), 0.0, {"cached": bool(obs.cached), "trajectory_id": traj.id}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The task's reward command in the request's workspace (0.0 when it has none)."""
        rid = self._request_id(instance_id, kwargs)
        with self._lock:
            traj = self._open.get(rid)
        if traj is None:
            raise StateConflict(f"verl tool {self.name}: request {rid} has no workspace",
                                hint="calc_reward after an execute of that request, before finish")
        reward = await asyncio.to_thread(traj.reward)
        return float(reward or 0.0)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """verl releases after every call: the request's workspace stays (``finish`` closes it)."""
        with self._lock:
            self._created.pop(instance_id, None)

    async def finish(self, request_id: str) -> None:
        """Close the workspace of ``request_id`` (the root stays for the other requests)."""
        with self._lock:
            traj = self._open.pop(request_id, None)
        if traj is not None:
            await asyncio.to_thread(traj.close)

    def open_requests(self) -> list[str]:
        with self._lock:
            return list(self._open)

    def close_all(self) -> None:
        with self._lock:
            trajs, self._open = list(self._open.values()), OrderedDict()
        for t in trajs:
            t.close()

    # --- private --------------------------------------------------------------------------

    @staticmethod
    def _request_id(instance_id: str, kwargs: Mapping[str, Any]) -> str:
        agent_data = kwargs.get("agent_data")
        rid = getattr(agent_data, "request_id", None) or kwargs.get("request_id")
        return str(rid) if rid else instance_id

    def _trajectory(self, instance_id: str, kwargs: Mapping[str, Any]) -> Trajectory:
        rid = self._request_id(instance_id, kwargs)
        with self._lock:
            traj = self._open.get(rid)
            if traj is not None:
                self._open.move_to_end(rid)
                return traj
            created = self._created.get(instance_id)
        if created is None:
            raise StateConflict(f"verl tool {self.name}: execute of {instance_id!r} before create",
                                hint="verl's tool loop calls create(create_kwargs=...) first")
        source = created if (created.get("task") is not None or created.get("task_file")) else self.config
        task = row_task(source, where=f"verl tool {self.name}'s create_kwargs")
        key = safe_id(str(created["instance_id"])) if created.get("instance_id") else task.id
        remote = client(self._url, token=self._token, token_file=self._token_file) if self._url else None
        traj = open_trajectory(task, key=key, client=remote, mode=self._mode, config=self._bunshin_config)
        with self._lock:
            self._open[rid] = traj
            over = [self._open.popitem(last=False)[1] for _ in range(max(0, len(self._open) - self._max_open))]
        for old in over:
            log.warning("verl tool %s: more than %d open requests, closing the oldest (%s)",
                        self.name, self._max_open, old.id)
            old.close()
        return traj
