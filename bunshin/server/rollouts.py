"""``POST /v1/rollouts``: the rollout engine run on the server, one group per call.

The engine (task root, prefix cache, speculation, rewards) runs on the server's event
loop; the answer is the group's rows (``TrajectoryResult.to_row``, the JSONL form of
``bunshin rollout``). The policy endpoint is called from the server: the token holder
chooses where it connects.
"""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter

from ..api import rollouts as r
from ..rollout import ModeOptions
from ..rollout.engine import rollout
from ..rollout.openai_client import OpenAIPolicy
from .context import ServerContext
from .images import image_id
from .tasks import http_task


def router(ctx: ServerContext) -> APIRouter:
    api = APIRouter(prefix="/v1")

    @api.post("/rollouts")
    async def run_rollouts(req: r.RunRollouts) -> r.RolloutsOut:
        task = http_task(req.task)
        image = await anyio.to_thread.run_sync(lambda: image_id(ctx.config, task.image))
        task = task.model_copy(update={"image": image})
        p = req.policy
        async with OpenAIPolicy(p.base_url, p.model, api_key=p.api_key, temperature=p.temperature,
                                max_tokens=p.max_tokens, timeout=p.timeout, retries=p.retries) as policy:
            group = await rollout(task, policy, req.n, mode=req.mode, config=ctx.config,
                                  options=ModeOptions(speculation=req.speculation), concurrency=req.concurrency)
        return r.RolloutsOut(run_id=group.run_id, task_id=group.task_id, group_id=group.group_id,
                             mode=group.mode, makespan_s=group.makespan_s, prepare_s=group.prepare_s,
                             rewards=group.rewards, rows=[t.to_row() for t in group.trajectories])

    return api
