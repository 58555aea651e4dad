"""mini-swe-agent's own agent loop (``DefaultAgent``, its ``DeterministicModel``) on bunshin
workspaces, built from the dotted class path as mini-swe-agent builds any environment:
locally, on a served host, and as a group forked from one root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

# mini-swe-agent prints a banner and makes a config folder on import: keep both quiet and private
_MSWEA_DIR = tempfile.TemporaryDirectory(prefix="mswea-")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", _MSWEA_DIR.name)

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from bunshin import Workspace  # noqa: E402
from bunshin.adapters._group import GROUPS, LocalGroups  # noqa: E402
from bunshin.adapters.miniswe import BunshinEnvironment, release_group  # noqa: E402
from bunshin.errors import InvalidArgument, SetupFailed  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.server.conftest import TOKEN, Served  # noqa: E402

CLASS = "bunshin.adapters.miniswe.BunshinEnvironment"
BUGGY = "def add(a, b):\n    return a - b\n"
TASK = {"cwd": "/work", "files": {"/work/calc.py": BUGGY}, "timeout": 5}
#: what the scripted model does: look, hang (times out), fix, check, submit
SCRIPT = [
    ("Look at the code.", "cat calc.py"),
    ("Wait for something that never comes.", "sleep 30"),
    ("Fix the operator.", "sed -i 's/a - b/a + b/' calc.py"),
    ("Check it.", "python3 -c 'import calc; print(calc.add(2, 3))' && echo oops >&2"),
    ("Done.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat calc.py"),
]


@pytest.fixture
def served(no_leaks) -> Iterator[Served]:
    """A real ``bunshin serve`` on loopback over the test's private home."""
    with serve_in_thread(no_leaks, TOKEN) as url:
        yield Served(url, TOKEN)


def _agent(env: Any) -> DefaultAgent:
    model = DeterministicModel(outputs=[make_output(text, [{"command": cmd}]) for text, cmd in SCRIPT])
    return DefaultAgent(model, env, system_template="You fix bugs.",
                        instance_template="{{task}} (on {{system}} {{machine}}, in {{cwd}})",
                        step_limit=10, cost_limit=0)


def _solve(env: Any) -> None:
    """mini-swe-agent's loop solves the task in ``env``; the observations are the workspace's."""
    agent = _agent(env)
    result = agent.run("Make add() add.")
    assert result["exit_status"] == "Submitted"
    assert "return a + b" in result["submission"]
    assert "(on Linux x86_64, in /work)" in agent.messages[1]["content"]  # template vars from inside
    obs = [m for m in agent.messages if m["role"] == "user"][1:]  # the observations, in order
    assert [o["extra"]["returncode"] for o in obs] == [0, -1, 0, 0]
    assert "return a - b" in obs[0]["extra"]["raw_output"]
    assert "timed out after 5 seconds" in obs[1]["extra"]["exception_info"]
    assert obs[1]["extra"]["exception_type"] == "TimeoutExpired"
    assert obs[3]["extra"]["raw_output"] == "5\noops\n"  # stderr merged, in order
    assert env.ws.files.read_text("/work/calc.py") == BUGGY.replace("a - b", "a + b")


def test_default_agent_solves_a_task_in_a_local_workspace(no_leaks) -> None:
    env = get_environment({"environment_class": CLASS, "home": str(no_leaks.home), **TASK})
    assert isinstance(env, BunshinEnvironment)
    try:
        _solve(env)
        data = env.serialize()["info"]["config"]
        assert data["environment_type"] == CLASS and data["workspace"] == env.ws.id
        assert not Path("/work/calc.py").exists()  # nothing reached the host
    finally:
        env.close()
    env.close()  # twice: a no-op


def test_default_agent_solves_a_task_on_a_served_host(served, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text(served.token)
    env = get_environment({"environment_class": CLASS, "url": served.url, "token_file": str(token), **TASK})
    try:
        assert env.ws.id in [w.id for w in served.client().list()]
        _solve(env)
    finally:
        env.close()
    assert served.client().list() == []


def test_execute_shapes_and_submit(no_leaks) -> None:
    with BunshinEnvironment(home=str(no_leaks.home), cwd="/tmp", env={"GREETING": "hi"}) as env:
        out = env.execute({"command": "echo $GREETING; pwd; exit 3"})
        assert out == {"output": "hi\n/tmp\n", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/")["output"] == "/\n"
        slow = env.execute({"command": "echo started; sleep 30"}, timeout=1)
        assert slow["returncode"] == -1 and slow["output"] == "started\n"
        with pytest.raises(Submitted) as sub:
            env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
        assert sub.value.messages[0]["extra"] == {"exit_status": "Submitted", "submission": "the patch\n"}
        # the submit line with a failing command is not a submission
        assert env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; exit 1"})["returncode"] == 1
        ws = env.ws
    assert not ws.is_alive()


def test_bad_config_and_failed_setup_leave_nothing(no_leaks, monkeypatch) -> None:
    monkeypatch.delenv("BUNSHIN_TOKEN", raising=False)
    with pytest.raises(ValidationError, match="no_such_option"):
        BunshinEnvironment(home=str(no_leaks.home), no_such_option=1)
    with pytest.raises(ValidationError, match="group"):
        BunshinEnvironment(home=str(no_leaks.home), group="no spaces allowed")
    with pytest.raises(SetupFailed, match="exited 7") as e:
        BunshinEnvironment(home=str(no_leaks.home), setup=["true", "echo broken >&2; exit 7"])
    assert "broken" in str(e.value) and e.value.hint
    with pytest.raises(InvalidArgument, match="group key") as ge:
        BunshinEnvironment.group(2, home=str(no_leaks.home))
    assert ge.value.hint
    with pytest.raises(InvalidArgument, match="n >= 1"):
        BunshinEnvironment.group(0, home=str(no_leaks.home), group="g")
    with pytest.raises(InvalidArgument, match="token") as te:
        BunshinEnvironment(url="http://127.0.0.1:9", token_file=None)
    assert "BUNSHIN_TOKEN" in (te.value.hint or "")
    groups = LocalGroups()
    with pytest.raises(SetupFailed):
        BunshinEnvironment(home=str(no_leaks.home), group="g-bad", setup=["exit 1"], groups=groups)
    assert groups.keys() == []  # a root that failed to build is not kept: the next caller retries


ROOT_SETUP = ["mkdir -p /work && echo built >> /work/setup.log", "echo 41 > /work/state"]


def test_group_fork_one_root_private_changes(no_leaks) -> None:
    kw = {"home": str(no_leaks.home), "group": "task-7", "setup": ROOT_SETUP, "cwd": "/work"}
    envs = BunshinEnvironment.group(3, **kw)  # the process's groups (GROUPS), as a config would use
    envs.append(get_environment({"environment_class": CLASS, **kw}))  # built from a config, same key
    try:
        assert "task-7" in GROUPS.keys()
        snap, built = GROUPS.root("task-7", lambda: pytest.fail("the root is built once"))
        assert not built
        parents = {Workspace.get(e.ws.id, config=no_leaks).info().parent for e in envs}
        assert parents == {snap.record.source}  # all four restored from the one root
        for i, env in enumerate(envs):
            assert env.execute({"command": "cat setup.log"})["output"] == "built\n"  # setup ran once
            env.execute({"command": f"echo {i} > state; echo mine-{i} > own"})
        for i, env in enumerate(envs):
            assert env.execute({"command": "cat state own"})["output"] == f"{i}\nmine-{i}\n"
    finally:
        for env in envs:
            env.close()
        assert release_group("task-7")
    assert not release_group("task-7")


def test_group_fork_on_a_served_host(served, monkeypatch) -> None:
    monkeypatch.setenv("BUNSHIN_TOKEN", served.token)
    kw = {"environment_class": CLASS, "url": served.url, "group": "srv-task", "setup": ROOT_SETUP, "cwd": "/work"}
    envs = [get_environment(kw) for _ in range(2)]  # two independent constructions, one key
    try:
        assert envs[0].ws.id != envs[1].ws.id
        for i, env in enumerate(envs):
            assert env.execute({"command": "cat setup.log"})["output"] == "built\n"
            env.execute({"command": f"echo {i} > state"})
        assert [e.execute({"command": "cat state"})["output"] for e in envs] == ["0\n", "1\n"]
        root = served.client().request("GET", "/v1/groups/srv-task").json()["root"]
        assert root.startswith("snap-")
    finally:
        for env in envs:
            env.close()
        release_group("srv-task", url=served.url)
    assert served.client().list() == []


def test_environments_nobody_closes_are_removed_at_exit(no_leaks) -> None:
    """As mini-swe-agent's own runners leave them (`mini` never closes its environment)."""
    script = (
        "from bunshin.adapters.miniswe import BunshinEnvironment\n"
        f"alone = BunshinEnvironment(home={str(no_leaks.home)!r})\n"
        f"grouped = BunshinEnvironment(home={str(no_leaks.home)!r}, group='at-exit', setup=['true'])\n"
        "print(alone.ws.id, grouped.ws.id)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MSWEA_SILENT_STARTUP": "1"})
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 2
    assert Workspace.list(config=no_leaks) == []  # and no_leaks: no root snapshot left either


def test_the_mini_cli_runs_on_bunshin_unchanged(no_leaks, tmp_path) -> None:
    """mini-swe-agent's own `mini` command, told the environment class by its dotted path."""
    steps = [("fix", "sed -i 's/a - b/a + b/' calc.py"), ("done", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat calc.py")]
    config = {
        "environment": {"environment_class": CLASS, "home": str(no_leaks.home), **TASK},
        "model": {"model_class": "deterministic", "model_name": "deterministic",
                  "outputs": [make_output(text, [{"command": cmd}]) for text, cmd in steps]},
    }
    (tmp_path / "bunshin.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    out = tmp_path / "traj.json"
    r = subprocess.run([sys.executable, "-m", "minisweagent.run.mini", "-c", "mini.yaml", "-c",
                        str(tmp_path / "bunshin.yaml"), "-y", "--exit-immediately", "-t", "Fix calc.add", "-o", str(out)],
                       capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                       env={**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    info = json.loads(out.read_text())["info"]
    assert info["exit_status"] == "Submitted" and "return a + b" in info["submission"]
    assert info["config"]["environment_type"] == CLASS
    assert Workspace.list(config=no_leaks) == []  # `mini` never closes it: removed at exit
