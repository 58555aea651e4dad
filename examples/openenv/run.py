"""An OpenEnv environment server on bunshin, driven through openenv-core's own client by a
scripted policy (as root: `python examples/openenv/run.py`).

The server is openenv-core's app (``bunshin.adapters.openenv.create_app``) on a loopback
port; four OpenEnv clients (what TRL's or SkyRL's OpenEnv integration opens, one per
rollout) each get a WebSocket session whose episode is a fork of the task's root, so
the task's slow setup ran once. To serve a task file instead:
``python -m bunshin.adapters.openenv task.yaml --port 8000``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from bunshin.adapters.openenv import BunshinAction, BunshinEnvClient, create_app
from bunshin.adapters.trajectories import close_all
from bunshin.server.thread import listening_socket

TASK = {
    "id": "openenv-example",
    "memory": "512M",
    "files": {"/work/calc.py": "def add(a, b):\n    return a - b\n"},
    "setup": ["sleep 2 && echo ready > /work/deps.log"],  # the slow part, run once
    "tools": ["bash", "read_file", "edit"],
    "workdir": "/work",
    "prompt": "Fix calc.add.",
    "max_turns": 5,
    "reward": "cd /work && python3 -B -c \"import calc; print(float(calc.add(2, 3) == 5))\"",
}
FIXES = ["a + b", "a * b", "b + a", "a - b"]


def rollout(url: str, fix: str) -> float:
    with BunshinEnvClient(base_url=url, message_timeout_s=120).sync() as env:
        env.reset()
        env.step(BunshinAction(tool="bash", arguments={"command": "cat deps.log"}))
        env.step(BunshinAction(tool="edit", arguments={"path": "calc.py", "old_str": "return a - b",
                                                       "new_str": f"return {fix}"}))
        result = env.step(BunshinAction(answer="fixed"))
        assert result.done
        return float(result.reward or 0.0)


def main() -> None:
    sock = listening_socket("127.0.0.1", 0)
    # "critical": openenv-core logs a traceback for every client that disconnects (it closes the socket again)
    server = uvicorn.Server(uvicorn.Config(create_app(TASK), log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        with ThreadPoolExecutor(len(FIXES)) as pool:
            rewards = list(pool.map(rollout, [url] * len(FIXES), FIXES))
    finally:
        server.should_exit = True
        thread.join(15)
        close_all()
    for fix, r in zip(FIXES, rewards, strict=True):
        print(f"return {fix:<6} reward {r}")
    assert rewards == [1.0, 0.0, 1.0, 0.0]


if __name__ == "__main__":
    main()
