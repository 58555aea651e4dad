"""Integration: forking while the host has a command in flight inside the workspace."""

from __future__ import annotations

import threading
import time

import pytest

from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_fork_during_a_running_session_command_finishes_in_every_clone(no_leaks):
    ws = Workspace.create("host", memory="512M", config=no_leaks)
    clones: list[Workspace] = []
    try:
        sh = ws.shell()
        result = {}
        cmd = "for i in 1 2 3; do sleep 0.4; echo tick$i; done; echo done > /tmp/finished; echo $((6*7))"
        runner = threading.Thread(target=lambda: result.setdefault("r", sh.run(cmd, timeout=30)))
        runner.start()
        time.sleep(0.5)  # the command is running, the host's call is in flight
        clones = ws.fork(2)
        runner.join(30)
        assert result["r"].output == "tick1\ntick2\ntick3\n42\n" and result["r"].exit_code == 0
        deadline = time.monotonic() + 10
        for c in clones:
            while c.exec(["test", "-e", "/tmp/finished"]).exit_code != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert c.files.read_text("/tmp/finished") == "done\n"
            # the session of the clone is free again and keeps its state
            assert c.agent().session_run(sh.id, "echo again $((1+1))", timeout=10).output == "again 2\n"
    finally:
        for c in clones:
            c.remove()
        ws.remove()


def test_fork_during_a_running_exec(no_leaks):
    ws = Workspace.create("host", memory="512M", config=no_leaks)
    clones: list[Workspace] = []
    try:
        result = {}
        runner = threading.Thread(target=lambda: result.setdefault("r", ws.exec("sleep 1; echo parent-done", timeout=30)))
        runner.start()
        time.sleep(0.3)
        clones = ws.fork(1)
        runner.join(30)
        assert result["r"].stdout == "parent-done\n"
        assert clones[0].exec(["echo", "clone-ok"]).stdout == "clone-ok\n"
    finally:
        for c in clones:
            c.remove()
        ws.remove()
