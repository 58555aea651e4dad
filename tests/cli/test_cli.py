"""Integration: the `bunshin` command line, across separate invocations, errors and gc."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bunshin.cli.main import main

pytestmark = pytest.mark.integration


def bunshin(cfg, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "BUNSHIN_CRIU": str(cfg.criu), "BUNSHIN_TMPFS": str(cfg.tmpfs)}
    proc = subprocess.run([sys.executable, "-m", "bunshin.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"bunshin {args} exited {proc.returncode}: {proc.stderr}")
    return proc


def test_lifecycle_across_invocations(no_leaks):
    cfg = no_leaks
    ws = json.loads(bunshin(cfg, "create", "--name", "cli-a", "--memory", "256M", "--json").stdout)
    try:
        assert ws["id"].startswith("ws-")
        r = bunshin(cfg, "exec", "cli-a", "--", "sh", "-c", "echo out; echo err >&2; exit 7", check=False)
        assert (r.returncode, r.stdout, r.stderr) == (7, "out\n", "err\n")
        r = bunshin(cfg, "exec", ws["id"], "--cwd", "/tmp", "-e", "A=b", "--", "sh", "-c", "echo $A $PWD")
        assert r.stdout == "b /tmp\n"
        r = bunshin(cfg, "exec", "cli-a", "--timeout", "0.5", "--", "sleep", "30", check=False)
        assert r.returncode == 124 and "timed out after 0.5 s" in r.stderr
        listed = json.loads(bunshin(cfg, "ls", "--json").stdout)
        assert [w["id"] for w in listed] == [ws["id"]] and listed[0]["state"] == "running"
        assert set(ws) >= {"id", "name", "image", "state", "pid", "created_at", "parent", "create_ms"}
        st = json.loads(bunshin(cfg, "stats", "cli-a", "--json").stdout)
        assert st["cgroup_bytes"] > 0 and st["pss_bytes"] > 0  # the HTTP API's StatsOut
        assert st["uss_bytes"] > 0 and st["processes"] >= 1 and st["id"] == ws["id"]
        assert "cli-a" in bunshin(cfg, "ls").stdout
    finally:
        bunshin(cfg, "rm", ws["id"])
    assert json.loads(bunshin(cfg, "ls", "--json").stdout) == []


def here(cfg, monkeypatch, capfd, *args: str) -> tuple[int, str, str]:
    """``bunshin ARGS`` run in this process (no interpreter start): exit code, stdout, stderr."""
    monkeypatch.setenv("BUNSHIN_HOME", str(cfg.home))
    monkeypatch.setenv("BUNSHIN_CRIU", str(cfg.criu))
    monkeypatch.setenv("BUNSHIN_TMPFS", str(cfg.tmpfs))
    code = main(list(args))
    out, err = capfd.readouterr()
    return code, out, err


def test_exit_codes_and_ls(no_leaks, monkeypatch, capfd):
    """docker's classes: 127 not found, 126 not executable, 125 bunshin's own failure, else the
    command's status; `ls -q` and `--filter`; `rm -f` (running, or missing) and `rm --all`."""
    run = functools.partial(here, no_leaks, monkeypatch, capfd)
    ws, other = (run("create", "--name", name, "--memory", "128M")[1].strip() for name in ("codes", "other"))
    try:
        assert run("exec", ws, "--", "sh", "-c", "exit 7")[0] == 7
        code, _, err = run("exec", ws, "--", "no-such-program")
        assert code == 127 and "executable not found: no-such-program" in err, err
        code, out, err = run("exec", ws, "--json", "--", "no-such-program")
        assert code == 127 and out == "", out
        code, _, err = run("exec", ws, "--", "/etc/hostname")
        assert code == 126 and "cannot execute /etc/hostname" in err, err
        code, _, err = run("exec", ws, "--cwd", "/no/such/dir", "--", "true")
        assert code == 125 and "no such directory" in err, err
        assert run("ls", "-q") == (0, f"{ws}\n{other}\n", "")
        assert run("ls", "-q", "--filter", "status=running", "-f", "name=codes")[1] == ws + "\n"
        assert run("ls", "-q", "--filter", f"id={ws[:6]}")[1] == ws + "\n"
        assert run("ls", "-q", "--filter", "status=dead")[1] == ""
        assert json.loads(run("ls", "--json", "--filter", "parent=ws-other")[1]) == []
        code, _, err = run("ls", "--filter", "colour=red")
        assert code == 125 and "KEY one of id, name, status, image, parent" in err
        code, out, err = run("rm", "-f", ws, "ws-nosuch", "--json")
        assert (code, json.loads(out), err) == (0, {"removed": [ws], "failed": []}, "")
        code, out, _ = run("rm", "--all", "--json")
        assert (code, json.loads(out)["removed"]) == (0, [other])
        assert run("ls", "-q")[1] == "" and run("rm", "--all") == (0, "", "")  # nothing left: no error
        code, _, err = run("rm")
        assert code == 125 and "bunshin rm WS... (or --all)" in err
    finally:
        run("rm", "-f", ws, other)


def test_exec_marks_output_cut_at_max_output(no_leaks):
    """Output past --max-output is never cut silently: a marker line on stderr and, for a
    command that exited 0, exit code 141; raised within the cap it all comes through."""
    ws = json.loads(bunshin(no_leaks, "create", "--memory", "256M", "--json").stdout)["id"]
    try:
        cmd = ("exec", ws, "--", "sh", "-c", "head -c 2000000 /dev/zero | tr '\\0' x")
        r = bunshin(no_leaks, *cmd, check=False)
        assert r.returncode == 141, r.stderr
        assert r.stdout == "x" * (1 << 20) and "stdout cut at 1.0 MiB" in r.stderr, r.stderr[-300:]
        r = bunshin(no_leaks, "exec", "--max-output", "2M", *cmd[1:])
        assert r.stdout == "x" * 2_000_000 and "cut" not in r.stderr
        failing = ("exec", ws, "--max-output", "1K", "--", "sh", "-c", "head -c 5000 /dev/zero; exit 3")
        r = bunshin(no_leaks, *failing, check=False)
        assert r.returncode == 3 and "stdout cut at 1.0 KiB" in r.stderr  # the command's own failure wins
        r = bunshin(no_leaks, "exec", ws, "--max-output", "17M", "--", "true", check=False)
        assert r.returncode == 125 and "max_output" in r.stderr and "Traceback" not in r.stderr
    finally:
        bunshin(no_leaks, "rm", ws)


@pytest.mark.parametrize(
    "args, message",
    [
        (("create", "--image", "/no/such/root"), "unknown image"),
        (("create", "--memory", "two gigs"), "malformed size"),
        (("exec", "ws-missing", "--", "true"), "no workspace"),
        (("stats", "nope"), "no workspace"),
        (("exec", "x", "-e", "NOEQUALS", "--", "true"), "no workspace"),
    ],
)
def test_errors_are_clear_without_traceback(no_leaks, args, message):
    r = bunshin(no_leaks, *args, check=False)
    assert r.returncode == 125
    assert message in r.stderr and "Traceback" not in r.stderr
    assert "hint:" in r.stderr or "error:" in r.stderr


def test_exec_into_removed_workspace(no_leaks):
    ws_id = bunshin(no_leaks, "create").stdout.strip()
    bunshin(no_leaks, "rm", ws_id)
    r = bunshin(no_leaks, "exec", ws_id, "--", "true", check=False)
    assert r.returncode == 125 and "no workspace" in r.stderr and "Traceback" not in r.stderr


def test_gc_after_creator_killed_mid_create(no_leaks):
    """A `kill -9` of the creating process between mount/cgroup and start: gc cleans it all."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from pathlib import Path
        from bunshin.config import Config
        from bunshin.runtime.container import lifecycle as container
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        container._launch = die
        from bunshin.workspace import Workspace
        Workspace.create("host", config=Config.for_home(Path({str(no_leaks.home)!r}), criu=Path({str(no_leaks.criu)!r})))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    from tests.conftest import leftovers

    left = leftovers(no_leaks)
    assert left.get("records") and left.get("mounts") and left.get("cgroups"), left
    report = json.loads(bunshin(no_leaks, "gc", "--json").stdout)
    assert report["workspaces"] == left["records"]
    assert leftovers(no_leaks) == {}


def test_gc_after_workspace_init_killed(no_leaks):
    ws_id = bunshin(no_leaks, "create").stdout.strip()
    listed = json.loads(bunshin(no_leaks, "ls", "--json").stdout)
    os.kill(listed[0]["pid"], signal.SIGKILL)
    time.sleep(0.2)
    assert json.loads(bunshin(no_leaks, "ls", "--json").stdout)[0]["state"] == "dead"
    r = bunshin(no_leaks, "exec", ws_id, "--", "true", check=False)
    assert r.returncode == 125 and "not running" in r.stderr
    report = json.loads(bunshin(no_leaks, "gc", "--json").stdout)
    assert report["workspaces"] == [ws_id]
    from tests.conftest import leftovers

    assert leftovers(no_leaks) == {}


def test_doctor(no_leaks):
    r = bunshin(no_leaks, "doctor", "--json")
    data = json.loads(r.stdout)
    assert data["ok"] is True
    names = {c["name"]: c for c in data["checks"]}
    assert {"root", "kernel", "overlayfs", "namespaces", "cgroups", "tmpfs", "huge pages", "criu",
            "pycriu"} <= names.keys()
    assert names["criu"]["ok"], names["criu"]
    assert names["huge pages"]["ok"], names["huge pages"]  # this machine's kernel has shmem THP


def test_doctor_reports_a_folder_without_huge_pages(no_leaks, tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "somebody's file").write_text("x")
    env_cfg = type(no_leaks)(home=no_leaks.home, tmpfs=folder, criu=no_leaks.criu, cgroup_prefix=no_leaks.cgroup_prefix)
    r = bunshin(env_cfg, "doctor", "--json", check=False)  # exits 1: the folder is not on a tmpfs either
    huge = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "huge pages")
    assert huge["ok"] is False and "non-empty folder" in huge["detail"] and "BUNSHIN_TMPFS" in huge["fix"]


def test_doctor_reports_missing_criu(no_leaks):
    env_cfg = type(no_leaks)(home=no_leaks.home, tmpfs=no_leaks.tmpfs, criu=no_leaks.home / "no-criu",
                             cgroup_prefix=no_leaks.cgroup_prefix)
    r = bunshin(env_cfg, "doctor", "--json")
    criu = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "criu")
    assert criu["ok"] is False and "make install" in criu["fix"]


def test_interactive_sh_on_a_terminal(no_leaks):
    """`bunshin sh` driven through a real pty, as a person at a terminal would."""
    import pty
    import select

    ws_id = bunshin(no_leaks, "create").stdout.strip()
    try:
        env = {**os.environ, "BUNSHIN_HOME": str(no_leaks.home), "TERM": "xterm"}
        pid, fd = pty.fork()
        if pid == 0:
            os.execve(sys.executable, [sys.executable, "-m", "bunshin.cli.main", "sh", ws_id], env)
        seen = b""

        def read_until(needle: bytes, timeout: float = 20) -> None:
            nonlocal seen
            deadline = time.monotonic() + timeout
            while needle not in seen and time.monotonic() < deadline:
                r, _, _ = select.select([fd], [], [], 0.2)
                if r:
                    try:
                        seen += os.read(fd, 4096)
                    except OSError:
                        break
            assert needle in seen, seen[-500:]

        read_until(b"# ")  # the shell's prompt: a person types after seeing it
        os.write(fd, b"cd /tmp; echo marker-$((40+2)) $(pwd)\r")
        read_until(b"marker-42 /tmp")
        os.write(fd, b"exit\r")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        os.close(fd)
    finally:
        bunshin(no_leaks, "rm", ws_id)


def test_gc_removes_agent_layers_of_older_agent_versions(no_leaks):
    from bunshin.runtime.agent_host.bundle import current_layer_name

    layers = no_leaks.tmpfs / "layers"
    old = layers / "agent-000000000000"
    (old / ".bunshin").mkdir(parents=True)
    ws_id = bunshin(no_leaks, "create").stdout.strip()  # builds (or reuses) the current agent layer
    try:
        report = json.loads(bunshin(no_leaks, "gc", "--json").stdout)
        assert str(old) in report["files"] and not old.exists()
        assert (layers / current_layer_name()).is_dir()
        assert bunshin(no_leaks, "exec", ws_id, "--", "true").returncode == 0
    finally:
        bunshin(no_leaks, "rm", ws_id)


def test_rm_of_many_workspaces_removes_them_together_and_reports_the_rest(no_leaks):
    root = bunshin(no_leaks, "create", "--memory", "128M").stdout.strip()
    clones: list[str] = []
    try:
        clones = [c["id"] for c in json.loads(bunshin(no_leaks, "fork", root, "-n", "3", "--json").stdout)["forks"]]
        r = bunshin(no_leaks, "rm", *clones, "ws-nosuch", root, "--json", check=False)
    finally:
        bunshin(no_leaks, "rm", *clones, root, check=False)  # whatever is left, if anything failed
    out = json.loads(r.stdout)
    assert r.returncode == 125 and out["failed"] == ["ws-nosuch"] and "no workspace" in r.stderr
    assert sorted(out["removed"]) == sorted([*clones, root])
    assert json.loads(bunshin(no_leaks, "ls", "--json").stdout) == []

