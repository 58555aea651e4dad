"""Integration: fork batches that cannot fit are refused, and interrupted ones leave nothing.

On the real runtime (CRIU). A ``bunshin fork WS -n 4`` subprocess is interrupted
(SIGINT) or killed (SIGKILL) while it restores: no clone and no fork snapshot may
be left running or recorded (after ``bunshin gc`` for the kill), and the parent
runs on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bunshin.errors import InvalidArgument, ResourceExhausted
from bunshin.runtime.snapshot import lifetime as rsnap_lifetime
from bunshin.runtime.snapshot import restoring as rsnap_restoring
from bunshin.runtime.state.records import WorkspaceState
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace

BUNSHIN = Path(sys.executable).parent / "bunshin"


def _env(cfg) -> dict[str, str]:
    return {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu), "BUNSHIN_TMPFS": str(cfg.tmpfs)}


def _records(cfg):
    with Store.open(cfg.db_path) as store:
        return store.list_workspaces(), rsnap_lifetime.list_all(store)


# --- refused up front (no CRIU needed for the checks themselves) ---------------------------


def test_check_batch_limits(monkeypatch):
    with pytest.raises(InvalidArgument, match="limit of 1024"):
        rsnap_restoring.check_batch(10_000, 1)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(InvalidArgument):
            rsnap_restoring.check_batch(bad, 1)  # type: ignore[arg-type]
    monkeypatch.setattr(rsnap_restoring, "_pid_max", lambda: 32768)
    monkeypatch.setattr(rsnap_restoring, "_tasks_now", lambda: 1000)
    rsnap_restoring.check_batch(100, 10)  # 1000 pids: fits
    with pytest.raises(ResourceExhausted) as e:
        rsnap_restoring.check_batch(1000, 40)  # 40,000 pids > 32768
    assert "40000 pids" in str(e.value) and "32768" in str(e.value) and "kernel.pid_max" in e.value.hint
    monkeypatch.setattr(rsnap_restoring, "_pid_max", lambda: 1 << 22)

    class Mem:
        available = 100 << 20

    monkeypatch.setattr(rsnap_restoring.psutil, "virtual_memory", lambda: Mem)
    with pytest.raises(ResourceExhausted, match="100 MiB of memory is available") as e:
        rsnap_restoring.check_batch(64, 1)  # 64 x 2 MiB > 100 MiB
    assert "at most 50 clones" in e.value.hint
    rsnap_restoring.check_batch(40, 1)


pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_too_many_clones_refused_and_nothing_created(no_leaks, monkeypatch):
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as ws:
        with pytest.raises(InvalidArgument, match="1024"):
            ws.fork(10_000)
        r = subprocess.run([str(BUNSHIN), "fork", ws.id, "-n", "10000"], capture_output=True, text=True,
                           env=_env(no_leaks), timeout=60)
        assert r.returncode != 0 and "1024" in r.stderr and "Traceback" not in r.stderr, r.stderr
        monkeypatch.setattr(rsnap_restoring, "_pid_max", lambda: 2000)  # as if the kernel had few pids left
        monkeypatch.setattr(rsnap_restoring, "_tasks_now", lambda: 1500)
        with pytest.raises(ResourceExhausted, match="pid_max"):
            ws.fork(200)
        recs, snaps = _records(no_leaks)
        assert [r.id for r in recs] == [ws.id] and snaps == []
        monkeypatch.undo()
        snap = ws.snapshot()
        try:
            with pytest.raises(InvalidArgument, match="1024"):
                snap.restore(1025)
            assert [r.id for r in _records(no_leaks)[0]] == [ws.id]
        finally:
            snap.remove()


def test_a_finished_fork_commits_its_clones(no_leaks):
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as ws:
        clones = ws.fork(2)
        try:
            recs = {r.id: r for r in _records(no_leaks)[0]}
            assert all(recs[c.id].owner_pid is None and recs[c.id].state == WorkspaceState.RUNNING for c in clones)
            with Store.open(no_leaks.db_path) as store:
                assert gc.collect(no_leaks, store).workspaces == []  # committed clones are kept
            assert all(c.exec("true").ok for c in clones)
        finally:
            for c in clones:
                c.remove()


def _fork_and_stop(cfg, ws: Workspace, sig: int) -> subprocess.Popen:
    """Start ``bunshin fork WS -n 12``; send ``sig`` once the first clone runs (more are pending:
    with 4 the batch could commit before the signal landed, and the fork then rightly succeeds)."""
    # SIGINT as a terminal gives it, even when the suite itself runs in the background
    # (a shell starts background jobs with SIGINT ignored, and Python keeps that)
    proc = subprocess.Popen([str(BUNSHIN), "fork", ws.id, "-n", "12"], env=_env(cfg),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    try:
        while True:
            clones = [r for r in _records(cfg)[0] if r.parent == ws.id]
            if any(r.state == WorkspaceState.RUNNING for r in clones):
                break
            assert proc.poll() is None, f"the fork ended before a clone ran: {proc.communicate()}"
            assert time.monotonic() < deadline, "no clone ran in 120 s"
            time.sleep(0.005)
        assert len(clones) < 12 or not all(r.state == WorkspaceState.RUNNING for r in clones)
        proc.send_signal(sig)
        proc.wait(timeout=120)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_sigint_mid_restore_leaves_nothing(no_leaks):
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as ws:
        proc = _fork_and_stop(no_leaks, ws, signal.SIGINT)
        err = proc.stderr.read()
        assert proc.returncode != 0, err
        assert "Traceback" not in err, err
        recs, snaps = _records(no_leaks)
        assert [r.id for r in recs] == [ws.id], "a clone survived the interrupted fork"
        assert snaps == [], "the fork's snapshot survived"
        assert ws.exec("echo alive").stdout == "alive\n"


def test_kill9_mid_restore_then_gc_leaves_nothing(no_leaks):
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as ws:
        proc = _fork_and_stop(no_leaks, ws, signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL
        r = subprocess.run([str(BUNSHIN), "gc"], capture_output=True, text=True, env=_env(no_leaks), timeout=120)
        assert r.returncode == 0, r.stderr
        recs, snaps = _records(no_leaks)
        assert [r.id for r in recs] == [ws.id], f"gc kept a clone of the killed fork: {recs}"
        assert snaps == []
        assert ws.is_alive() and ws.exec("echo alive").stdout == "alive\n"


def test_sigint_during_a_restore_in_the_calling_thread_rolls_it_back_whole(no_leaks, monkeypatch):
    """``restore(1)`` runs in the caller's thread: a Ctrl-C that lands while criu restores
    waits for the clone to be whole, then rolls it back (KeyboardInterrupt, nothing left)."""
    real, made = rsnap_restoring._restore_one, []

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # lands at once: Python's handler would raise here
        made.append(real(*args, **kwargs))  # the real restore, whole
        return made[-1]

    handler = signal.getsignal(signal.SIGINT)
    with Workspace.create("host", memory="256M", pids=64, config=no_leaks) as ws:
        snap = ws.snapshot()
        try:
            monkeypatch.setattr(rsnap_restoring, "_restore_one", interrupted)
            with pytest.raises(KeyboardInterrupt):
                snap.restore(1)
            monkeypatch.undo()
            assert len(made) == 1 and made[0].state == WorkspaceState.RUNNING  # it was made, then rolled back
            assert [r.id for r in _records(no_leaks)[0]] == [ws.id], "the interrupted restore left its clone"
            with contextlib.suppress(psutil.NoSuchProcess):  # killed: gone, or a zombie until reaped
                assert psutil.Process(made[0].pid).status() == psutil.STATUS_ZOMBIE
            assert signal.getsignal(signal.SIGINT) is handler
            (clone,) = snap.restore(1)  # the snapshot serves on
            assert clone.exec("echo ok").stdout == "ok\n"
            clone.remove()
        finally:
            snap.remove()
