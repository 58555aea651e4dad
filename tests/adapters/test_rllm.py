"""rLLM: BunshinEnv (BaseEnv's interface as rLLM's source defines it: rLLM is not on PyPI) and
BunshinSandbox (its sandbox protocol) on real workspaces, locally and on a served host."""

from __future__ import annotations

import subprocess

import pytest

from bunshin import Workspace
from bunshin.adapters.rllm import BunshinEnv, BunshinSandbox
from bunshin.errors import InvalidArgument, StateConflict

from .conftest import TASK

pytestmark = [pytest.mark.integration, pytest.mark.criu]
ROW = {"task": TASK.model_dump(mode="json"), "instance_id": "rllm-1"}


def test_envs_of_an_instance_fork_one_root_and_score(home, monkeypatch):
    monkeypatch.setenv("BUNSHIN_HOME", str(home.home))
    envs = [BunshinEnv.from_dict(dict(ROW)) for _ in range(3)]
    try:
        ids = []
        for i, env in enumerate(envs):
            obs, info = env.reset()
            assert obs["prompt"] == "write the score" and info["instance_id"] == "rllm-1"
            obs, r, done, _ = env.step({"name": "bash", "arguments": {"command": f"cat setup.id; echo {i} > score"}})
            assert (r, done) == (0.0, False) and obs["tool_outputs"][0]["name"] == "bash"
            ids.append(obs["output"].split()[0])
        assert len(set(ids)) == 1
        assert [env.step("done")[1:3] for env in envs] == [(0.0, True), (1.0, True), (2.0, True)]
        envs[0].reset()  # a new rollout: a fresh fork of the root
        obs, *_ = envs[0].step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
        assert "score" not in obs["output"] and "setup.id" in obs["output"]
        obs, r, done, info = envs[0].step([{"name": "bad tool", "arguments": {}}])
        assert "unknown tool" in obs["output"]
        obs, r, done, info = envs[0].step([42])  # not a call: the model is told, the rollout goes on
        assert "not '42'" in obs["output"] and not done and info["error"]
    finally:
        for env in envs:
            env.close()
    with pytest.raises(StateConflict, match="reset"):
        envs[0].step("x")
    with pytest.raises(InvalidArgument, match="names no bunshin task"):
        BunshinEnv.from_dict({"instance_id": "x"})


def test_sandbox_protocol_on_an_env_and_on_its_own(home, monkeypatch, tmp_path):
    monkeypatch.setenv("BUNSHIN_HOME", str(home.home))
    (tmp_path / "proj" / "pkg").mkdir(parents=True)
    (tmp_path / "proj" / "pkg" / "mod.py").write_text("X = 1\n")
    (tmp_path / "proj" / ".git").mkdir()
    (tmp_path / "proj" / ".git" / "HEAD").write_text("ref\n")
    (tmp_path / "proj" / "link").symlink_to("/etc/hostname")
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "run.sh").chmod(0o755)
    env = BunshinEnv.from_dict(dict(ROW))
    try:
        env.reset()
        sb = env.sandbox()
        assert sb.exec("cat /work/setup.log") == "setup-ran\n" and sb.is_alive()
        sb.upload_dir(str(tmp_path / "proj"), "/work/proj")
        assert sb.exec("cd /work/proj && find . | sort") == ".\n./pkg\n./pkg/mod.py\n"  # no .git, no symlink
        sb.upload_file(str(tmp_path / "run.sh"), "/work/bin/run.sh")
        assert sb.exec("/work/bin/run.sh") == "ran\n"
        with pytest.raises(subprocess.CalledProcessError) as e:
            sb.exec("echo out; echo err >&2; exit 3")
        assert (e.value.returncode, e.value.stdout, e.value.stderr) == (3, "out\n", "err\n")
        with pytest.raises(subprocess.TimeoutExpired):
            sb.exec("sleep 5", timeout=0.5)
        with pytest.raises(InvalidArgument, match="root"):
            sb.exec("id", user="nobody")
        with pytest.raises(InvalidArgument):
            sb.upload_file(str(tmp_path / "missing"), "/x")
        sb.exec("echo 3 > /work/score")
        assert env.step("done")[1] == 3.0  # the sandbox is the rollout's own workspace
    finally:
        env.close()
    ws = Workspace.create("host", memory="256M", config=home)
    own = BunshinSandbox(ws)
    assert own.exec("echo hi") == "hi\n" and own.is_alive()
    own.close()
    own.close()
    assert not own.is_alive()


def test_envs_on_a_served_host_share_its_root(served):
    row = {**ROW, "instance_id": "rllm-served", "url": served.url, "token": served.token}
    envs = [BunshinEnv.from_dict(dict(row)) for _ in range(2)]
    try:
        ids = []
        for env in envs:
            env.reset()
            ids.append(env.step({"name": "bash", "arguments": {"command": "cat setup.id"}})[0]["output"].split()[0])
            assert env.sandbox().exec("cat /work/setup.log") == "setup-ran\n"
        assert ids[0] == ids[1]
        assert env.step("done")[1:3] == (0.0, True)
    finally:
        for env in envs:
            env.close()
        with served.client() as c:
            c.request("DELETE", "/v1/groups/rllm-served")
