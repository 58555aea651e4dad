"""Start the real agent as a host subprocess and drive it through ``AgentClient``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from bunshin.runtime.agent_host.client import AgentClient

REPO = Path(__file__).resolve().parents[2]
#: Set in the agent's environment; children must never see it.
LEAK_MARKER = "BUNSHIN_TEST_AGENT_ONLY"


@dataclass
class RunningAgent:
    proc: subprocess.Popen[bytes]
    client: AgentClient
    socket: Path
    run_dir: Path
    log: Path
    prefixed: bool = False

    @property
    def agent_pid(self) -> int:
        """Host pid of the agent itself (below the launcher when one is used)."""
        children = psutil.Process(self.proc.pid).children()
        return children[0].pid if self.prefixed and children else self.proc.pid

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """SIGTERM the agent (SIGKILL as pid 1, which ignores other signals); it must
        exit and take every child with it."""
        left = self.descendants()
        if self.proc.poll() is None:
            os.kill(self.agent_pid, signal.SIGKILL if self.prefixed else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("the agent did not exit on SIGTERM") from None
        _gone, alive = psutil.wait_procs(left, timeout=5)
        for p in alive:
            p.kill()
        assert not alive, f"the agent left processes behind: {alive}"


def start_agent(socket_path: Path, run_dir: Path, *prefix: str, calls: str = "thread") -> RunningAgent:
    log = run_dir.parent / f"{socket_path.stem}.log"
    env = {**os.environ, LEAK_MARKER: "1", "PYTHONPATH": str(REPO)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "bunshin.agent", "--socket", str(socket_path),
             "--run-dir", str(run_dir), "--calls", calls],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
        )  # fmt: skip
    client = AgentClient(socket_path)
    agent = RunningAgent(proc, client, socket_path, run_dir, log, prefixed=bool(prefix))
    try:
        client.wait_ready(15)
    except BaseException:
        agent.stop()
        raise
    return agent


@pytest.fixture(scope="module", params=["thread", "fork"])
def calls(request: pytest.FixtureRequest) -> str:
    """How the agent serves calls (``--calls``): every agent test runs both ways."""
    return str(request.param)


@pytest.fixture
def agent_factory(tmp_path: Path, calls: str) -> Iterator[Callable[..., RunningAgent]]:
    """Start extra agents (``start_agent`` arguments); all are stopped afterwards."""
    started: list[RunningAgent] = []

    def factory(socket_path: Path, run_dir: Path, *prefix: str) -> RunningAgent:
        started.append(start_agent(socket_path, run_dir, *prefix, calls=calls))
        return started[-1]

    yield factory
    for running in started:
        running.stop()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, calls: str) -> Iterator[RunningAgent]:
    """One agent shared by a module's tests."""
    base = tmp_path_factory.mktemp("agent")
    running = start_agent(base / "agent.sock", base / "run", calls=calls)
    yield running
    running.stop()
    assert not running.socket.exists(), "the agent did not remove its socket"


@pytest.fixture
def fresh_agent(tmp_path: Path, calls: str) -> Iterator[RunningAgent]:
    """An agent of the test's own."""
    running = start_agent(tmp_path / "agent.sock", tmp_path / "run", calls=calls)
    yield running
    running.stop()


@pytest.fixture
def client(agent: RunningAgent) -> AgentClient:
    return agent.client
