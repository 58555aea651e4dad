"""Attacks on the host through paths and sockets a workspace can write (issue 9).

Each test plays the attacker: as root inside a real workspace it plants a symlink whose
target string names a host path (inside, that path does not exist; it matters because
the HOST would resolve it), then drives the host through fork, copy-mode fork, snapshot,
remove, a ``kill -9`` of the forking process followed by ``gc``, or an agent call. The
host's canary folder and file must come out untouched (same names, contents, inode,
link count 1), the fake host socket must receive nothing, and the operation must work
or fail cleanly (``no_leaks``).

Where root inside may not write ``/.bunshin`` (a user namespace: the folder is host
root's), the plant is refused inside; the host side is then exercised with the same
entries put straight into a frozen layer, as a workspace with more rights would leave it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bunshin.errors import AgentError
from bunshin.runtime.agent_host.client import AgentClient
from bunshin.runtime.container import lifecycle as container
from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
from bunshin.runtime.snapshot import sweeping as rsnap_sweeping
from bunshin.runtime.snapshot import taking as rsnap_taking
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace

pytestmark = [pytest.mark.integration, pytest.mark.criu]

REPO = Path(__file__).resolve().parents[2]
MEMFILE_NAME = "x" + rsnap_taking.memfile.SUFFIX


# ------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class Canary:
    """A host folder with two files (one named like a memory file) that nothing may touch."""

    folder: Path
    inodes: dict[str, int]
    contents: dict[str, bytes]

    @classmethod
    def make(cls, tmp_path: Path) -> Canary:
        folder = tmp_path / "canary"
        folder.mkdir()
        contents = {"keep.txt": b"host data\n", MEMFILE_NAME: b"not a memory file\n"}
        for name, data in contents.items():
            (folder / name).write_bytes(data)
        return cls(folder, {n: (folder / n).stat().st_ino for n in contents}, contents)

    @property
    def file(self) -> Path:
        return self.folder / MEMFILE_NAME

    def assert_untouched(self) -> None:
        assert sorted(os.listdir(self.folder)) == sorted(self.contents), "the host folder was written to"
        for name, data in self.contents.items():
            st = os.lstat(self.folder / name)
            assert st.st_ino == self.inodes[name] and st.st_nlink == 1, f"{name} was replaced or linked"
            assert (self.folder / name).read_bytes() == data, f"{name} was changed"


def plant(ws: Workspace, script: str) -> bool:
    """Run ``script`` as root inside; False if the workspace refused it (no right to)."""
    r = ws.exec(["sh", "-c", script], timeout=30)
    return r.exit_code == 0


MEM_SYMLINK = 'mkdir -p /.bunshin && ln -sfn "$0" /.bunshin/mem'
MEM_FOLDER = ('mkdir -p /.bunshin/mem && ln -sf "$0/' + MEMFILE_NAME + '" /.bunshin/mem/' + MEMFILE_NAME
              + ' && ln -sfn "$0" /.bunshin/mem/sub && echo own > /.bunshin/mem/own' + rsnap_taking.memfile.SUFFIX)


def plant_mem(ws: Workspace, canary: Canary, script: str) -> str:
    """Plant ``script``'s entries at /.bunshin/mem as root inside; where that is refused
    (a user namespace), put them in the upper from the host, as a workspace with more
    rights would leave them (the frozen copy reads the upper directly). Returns where."""
    r = ws.exec(["sh", "-c", script, str(canary.folder)], timeout=30)
    if r.exit_code == 0:
        return "inside"
    mem = Path(ws.record.upper) / rsnap_lifetime.MEM_VIEW.lstrip("/")
    if script == MEM_SYMLINK:
        mem.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(canary.folder, mem)
    else:
        mem.mkdir(parents=True, exist_ok=True)
        os.symlink(canary.file, mem / MEMFILE_NAME)
        os.symlink(canary.folder, mem / "sub")
    return "upper"


def assert_works(ws: Workspace) -> None:
    r = ws.exec("echo alive", timeout=30)
    assert r.exit_code == 0 and r.stdout.strip() == "alive", r


def snap_layers(cfg) -> list[Path]:
    layers = cfg.tmpfs / "layers"
    return sorted(layers.glob("snap-*")) if layers.is_dir() else []


# ------------------------------------------------------- /.bunshin/mem (files)


@pytest.fixture
def tmpfs_folder(family) -> Iterator[Path]:
    """A host folder on bunshin's own tmpfs, where a hard link of a memory file would succeed."""
    folder = Path(tempfile.mkdtemp(prefix="canary-", dir=family.cfg.tmpfs))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("mode", ["cow", "copy"])
@pytest.mark.parametrize("where", ["tmp", "tmpfs"])
def test_mem_symlink_to_host_folder_fork_and_remove(family, tmp_path, request, mode, where):
    ws = family.create()
    canary = Canary.make(tmp_path if where == "tmp" else request.getfixturevalue("tmpfs_folder"))
    plant_mem(ws, canary, MEM_SYMLINK)
    (clone,) = family.fork(ws, mode=mode)
    assert_works(clone)
    assert_works(ws)
    canary.assert_untouched()
    clone.remove()  # the last holder of the snapshot: its layer and memory files go now
    assert snap_layers(family.cfg) == []
    canary.assert_untouched()


def test_mem_folder_with_symlinked_memfile_snapshot_and_remove(family, tmp_path):
    canary = Canary.make(tmp_path)
    ws = family.create()
    plant_mem(ws, canary, MEM_FOLDER)
    snap = ws.snapshot()
    family.snapshots.append(snap)
    layer_mem = Path(snap.record.layer) / rsnap_lifetime.MEM_VIEW.lstrip("/")
    # the frozen layer's view is the host's own folder, holding only real memory files
    assert not layer_mem.is_symlink() and layer_mem.is_dir()
    assert all(not p.is_symlink() and p.name.endswith(rsnap_taking.memfile.SUFFIX) for p in layer_mem.iterdir())
    (clone,) = snap.restore(1)
    family.workspaces.append(clone)
    assert_works(clone)
    clone.remove()
    snap.remove()
    canary.assert_untouched()


def test_bunshin_folder_symlink_in_a_frozen_layer(family, tmp_path):
    """``/.bunshin`` itself a symlink (and ``mem`` a real folder of symlinks) in a layer:
    removing it (what ``rm``, a failed take and ``gc`` do) unlinks, never follows."""
    canary = Canary.make(tmp_path)
    with Store.open(family.cfg.db_path) as store:
        rsnap_sweeping.sweep(family.cfg, store)
    layers = family.cfg.tmpfs / "layers"
    layers.mkdir(parents=True, exist_ok=True)
    a, b = layers / "snap-000000attack", layers / "snap-000001attack"
    for layer in (a, b):
        layer.mkdir()
    os.symlink(canary.folder, a / ".bunshin")
    (b / ".bunshin" / "mem").mkdir(parents=True)
    os.symlink(canary.file, b / ".bunshin" / "mem" / MEMFILE_NAME)
    os.symlink(canary.folder, b / ".bunshin" / "mem" / "sub")
    with Store.open(family.cfg.db_path) as store:
        freed = rsnap_sweeping.sweep(family.cfg, store)  # orphans, as gc finds them after a crash
    assert {str(a), str(b)} <= set(freed)
    assert not a.exists() and not b.exists()
    canary.assert_untouched()


def test_kill_9_of_the_forker_then_gc(family, tmp_path):
    canary = Canary.make(tmp_path)
    ws = family.create()
    plant_mem(ws, canary, MEM_SYMLINK)
    cfg = family.cfg
    script = (
        "import sys; from pathlib import Path; from bunshin.config import Config; from bunshin.workspace import Workspace\n"
        "cfg = Config.for_home(Path(sys.argv[1]), criu=Path(sys.argv[2]))\n"
        "Workspace.get(sys.argv[3], config=cfg).fork(1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(cfg.home), str(cfg.criu), ws.id],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not snap_layers(cfg) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    _wait_criu_gone(cfg)
    with Store.open(cfg.db_path) as store:
        gc.collect(cfg, store)
    assert snap_layers(cfg) == []
    canary.assert_untouched()
    assert_works(ws)


def _wait_criu_gone(cfg, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ps = subprocess.run(["pgrep", "-af", "criu"], capture_output=True, text=True).stdout
        if not any(str(cfg.tmpfs) in ln or str(cfg.home) in ln for ln in ps.splitlines()):
            return
        time.sleep(0.05)


def test_agent_log_symlink_is_not_read(family, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret\n")
    ws = family.create()
    assert plant(ws, f"ln -sf {secret} /.bunshin/run/agent.log")
    tail = container.agent_log_tail(ws.record)
    assert "host secret" not in tail and tail == "(no agent log)"


# ------------------------------------------------------------ the agent socket


class FakeAgent:
    """A listening unix socket on the host answering forged JSON; records what it gets."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="bsh-fake-", dir="/tmp"))
        self.path = self.folder / "agent.sock"
        self.connections = 0
        self.received = b""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(self.path))
        self._sock.listen(8)
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    self.received += conn.recv(65536)
                    conn.sendall(b'{"ok": true, "pid": 1, "version": "forged", "uptime_s": 1, "job_id": "j",'
                                 b' "running": false, "exit_code": 0, "stdout": "forged"}\n')

    def __enter__(self) -> FakeAgent:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def fake_agent() -> Iterator[FakeAgent]:
    with FakeAgent() as fake:
        yield fake


def test_run_folder_symlink_to_a_host_socket_is_refused(family, fake_agent):
    ws = family.create()
    # the first step fails where root inside may not write /.bunshin, before anything is removed
    planted = plant(ws, f"ln -s {fake_agent.folder} /.bunshin/run.new && rm -rf /.bunshin/run"
                        " && mv -T /.bunshin/run.new /.bunshin/run")
    if planted:
        with pytest.raises(AgentError, match="not a folder"):
            ws.exec("true", timeout=10)
    else:  # root inside may not replace /.bunshin/run (user namespace): the agent still answers
        assert_works(ws)
    assert fake_agent.connections == 0 and fake_agent.received == b""


def _unhealed(rec) -> AgentClient:
    """The workspace's client, without asking the agent to re-create its socket."""
    return AgentClient(container.socket_path(rec), beneath=Path(rec.root), expect_pid=rec.pid, rebind=False)


def test_socket_symlink_to_a_host_socket_is_refused(family, fake_agent):
    """The link is never followed; the agent, asked by the host, puts its socket back."""
    ws = family.create()
    assert plant(ws, f"rm -f /.bunshin/run/agent.sock && ln -s {fake_agent.path} /.bunshin/run/agent.sock")
    with pytest.raises(AgentError, match="not a socket"):
        _unhealed(ws.record).ping()
    assert_works(ws)  # the call found the link, asked the agent, which re-created its socket
    assert container.agent(ws.record).ping().pid == 1
    assert fake_agent.connections == 0 and fake_agent.received == b""


REBIND = """
import os, socket
p = "/.bunshin/run/agent.sock"
os.unlink(p)
s = socket.socket(socket.AF_UNIX)
s.bind(p)
s.listen(8)
open("/tmp/fake.ready", "w").close()
while True:  # an impostor that keeps listening, whatever a caller does (the host hangs up at once)
    c, _ = s.accept()
    try:
        data = c.recv(65536)
        if data:
            open("/tmp/fake.got", "ab").write(data)
        c.sendall(b'{"ok": true, "pid": 1, "version": "forged", "uptime_s": 1}\\n')
    except OSError:
        pass
    finally:
        c.close()
"""


@pytest.mark.parametrize("where", ["parent", "clone"])
def test_rebound_agent_socket_is_refused(family, where):
    """A process inside deletes the agent's socket and listens there itself: the host
    refuses it (SO_PEERCRED is not the workspace's pid 1), also in a restored clone, and
    the agent, asked, takes its socket's name back."""
    ws = family.create()
    if where == "clone":
        (ws,) = family.fork(ws)
        assert_works(ws)  # a restored agent passes the check
    ws.files.write("/root/rebind.py", REBIND)
    ws.commands.spawn(["python3", "/root/rebind.py"])
    upper = Path(ws.record.upper)
    deadline = time.monotonic() + 30
    while not (upper / "tmp" / "fake.ready").exists():
        assert time.monotonic() < deadline, "the rebinding process did not start"
        time.sleep(0.02)
    with pytest.raises(AgentError, match="not the workspace agent's"):
        _unhealed(ws.record).ping()
    assert_works(ws)
    assert container.agent(ws.record).ping().pid == 1
    assert not (upper / "tmp" / "fake.got").exists(), "the host sent a request to the impostor"
