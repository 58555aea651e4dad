"""Your own policy in a training loop (as root: `python examples/trainer_policy.py`; no GPU,
no download, well under a minute).

The "model" is a toy: a softmax over three answers to the task's question. Each
iteration runs one group of 8 trajectories of the task through bunshin's rollout
engine (the task's setup runs once; every trajectory is a fork of that root), turns
the group's rewards into GRPO-style advantages (reward minus the group's mean) and
moves the model's logits toward what scored. Swap `act` for your model's generate
call (``ctx.messages`` and ``ctx.tools`` in, tool calls out) and `update` for your
optimizer step.
"""

import asyncio
import math
import random

from bunshin import CallablePolicy, PolicyContext, RolloutEngine, TaskSpec

TASK = TaskSpec(
    id="count-files",
    memory="512M",
    setup=["mkdir -p /work/data && touch /work/data/a /work/data/b /work/data/c"],  # once, then forked
    prompt="How many files are in /work/data? Write the number to /work/answer.",
    tools=["bash"],
    max_turns=2,
    reward='[ "$(cat /work/answer)" = 3 ] && echo 1 || echo 0',  # the last number printed
)
ANSWERS = ["2", "3", "4"]
logits = [0.0, 0.0, 0.0]  # the model's parameters
picks: dict[int, int] = {}  # what each trajectory of the current group sampled, by its index
rng = random.Random(0)


def probs() -> list[float]:
    z = [math.exp(x) for x in logits]
    return [x / sum(z) for x in z]


def act(ctx: PolicyContext) -> list[dict] | None:
    """One turn: sample an answer and write it with the bash tool; then stop (None)."""
    if ctx.turn > 0:
        return None
    pick = picks[ctx.index] = rng.choices(range(len(ANSWERS)), weights=probs())[0]
    return [{"name": "bash", "arguments": {"command": f"echo {ANSWERS[pick]} > /work/answer"}}]


def update(rewards: list[float], lr: float = 4.0) -> None:
    """REINFORCE with the group's mean as the baseline (GRPO's advantage)."""
    mean = sum(rewards) / len(rewards)
    p = probs()
    for i, r in enumerate(rewards):
        pick = picks[i]
        for k in range(len(logits)):
            logits[k] += lr * (r - mean) * ((k == pick) - p[k]) / len(rewards)


async def main() -> None:
    async with RolloutEngine("bunshin") as engine:  # group fork + prefix cache + speculation
        for it in range(3):
            picks.clear()
            group = await engine.run_group(TASK, CallablePolicy(act), n=8)
            rewards = [r or 0.0 for r in group.rewards]  # None: the trajectory failed
            update(rewards)
            print(f"iteration {it}: rewards {rewards} mean {sum(rewards) / 8:.2f} "
                  f"p(correct) {probs()[1]:.2f} ({group.makespan_s:.1f} s)")


asyncio.run(main())
