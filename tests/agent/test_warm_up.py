"""``AgentServer.warm_up``: the call paths answered before the agent is ready, nothing left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, os, sys
from bunshin.agent.server import Agent, AgentServer
run = sys.argv[1]
agent = Agent(run, calls="thread")
server = AgentServer(agent, os.path.join(run, "agent.sock"))
agent.start()
server.bind()
answers = []
answer = server._answer
server._answer = lambda line: answers.append(answer(line)) or answers[-1]
server.warm_up(2)
assert server.thread_jobs is not None
print(json.dumps({"answers": [json.loads(a) for a in answers], "jobs_left": len(server.thread_jobs._jobs),
                  "children_left": len(agent.reaper.live())}))
server.close()
"""


def test_warm_up_answers_pings_stats_and_execs_of_its_own_executable(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    answers = r["answers"]
    # per round: ping, stat, job_start, the job's exec itself and the job_wait that fetched it
    assert len(answers) == 10 and all(a["ok"] for a in answers), answers
    execs = [a for a in answers if "exit_code" in a]
    assert len(execs) == 4
    for a in execs:  # /proc/self/exe --version: here the test's Python, in a workspace the loader
        assert a["exit_code"] == 0 and "Python" in a["stdout"] + a["stderr"], a
    assert r["jobs_left"] == 0 and r["children_left"] == 0  # every answer fetched, every child reaped
    assert not (tmp_path / "agent.sock").exists()
