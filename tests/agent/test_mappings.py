"""The extension modules a ready agent has mapped: each costs ~5 mappings that CRIU
looks up, opens and dumps on every fork of a clone, so only those its calls need."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bunshin.runtime.agent_host.bundle import agent_python
from bunshin.runtime.agent_host.client import AgentClient

AGENT_SRC = Path(__file__).resolve().parents[2] / "bunshin" / "agent"
#: What the agent's calls use (sockets, selectors, base64, fork_exec, ptys, ctypes' prctl, json).
NEEDED = frozenset({"_socket", "math", "select", "array", "binascii", "fcntl", "_posixsubprocess",
                    "termios", "_struct", "_ctypes", "_json",
                    "_typing"})  # typing's below 3.12 (built in from 3.12)


def _extension_modules(pid: int) -> set[str]:
    names = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            path = line.split()[5] if len(line.split()) >= 6 else ""
            if "/lib-dynload/" in path:
                names.add(os.path.basename(path).split(".")[0])
    return names


def test_a_ready_agent_maps_only_the_extension_modules_its_calls_use(tmp_path):
    # as in a workspace: the package alone on the path (``bunshin/__init__`` imports much more)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "bunshin_agent").symlink_to(AGENT_SRC)
    run = tmp_path / "run"
    run.mkdir()
    sock = run / "agent.sock"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(tmp_path / "pkg"), "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.Popen([str(agent_python().binary), "-s", "-B", "-m", "bunshin_agent", "--socket", str(sock),
                             "--run-dir", str(run)], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = AgentClient(sock)
        client.wait_ready(30)
        client.exec(["true"])
        loaded = _extension_modules(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert "_socket" in loaded  # the check sees what is loaded (a build with them built in: none)
    assert loaded <= NEEDED, f"loaded but not needed: {sorted(loaded - NEEDED)}"
    assert not loaded & {"zlib", "_bz2", "_lzma", "_opcode"}  # shutil's and inspect's
