"""The ``host`` image shows the OS's own folders and nothing else of the host (issue 9).

Canaries the test plants on the host (a new top-level folder with a file in it, a
top-level file, a secret under /root) must not be visible inside; /etc's secrets are
empty; bunshin's own state (its home, /opt/bunshin) and the checkout are not there;
the OS's programs still run.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import stat
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.runtime.container import images
from bunshin.workspace import Workspace

from ..conftest import drop_state_tmpfs, leftovers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def canaries():
    tag = secrets.token_hex(4)
    folder, top_file, secret = Path(f"/bunshin-canary-{tag}"), Path(f"/bunshin-canary-{tag}.txt"), \
        Path(f"/root/.bunshin-canary-{tag}")
    folder.mkdir()
    (folder / "inside.txt").write_text("canary in a new host folder\n")
    top_file.write_text("canary at the top\n")
    secret.write_text("canary secret of root\n")
    try:
        yield folder, top_file, secret
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        top_file.unlink(missing_ok=True)
        secret.unlink(missing_ok=True)


@pytest.fixture
def ws(no_leaks, canaries):
    w = Workspace.create("host", memory="512M", pids=128, config=no_leaks)
    yield w
    w.remove()


def gone(ws: Workspace, path: str | Path) -> bool:
    r = ws.exec(["sh", "-c", 'test -e "$1" || test -L "$1"', "-", str(path)])
    return r.exit_code == 1


def test_canaries_are_invisible(ws, canaries):
    folder, top_file, secret = canaries
    assert gone(ws, folder / "inside.txt") and gone(ws, top_file) and gone(ws, secret)
    r = ws.exec(["cat", str(folder / "inside.txt"), str(top_file), str(secret)])
    assert r.exit_code != 0 and "canary" not in r.stdout
    assert "canary" not in ws.exec("ls -A /root; cat /root/.bunshin-canary-* /bunshin-canary-*/* 2>/dev/null").stdout
    assert top_file.name not in ws.exec("ls -A /").stdout  # a top-level file is whited out
    assert ws.exec(["ls", "-A", str(folder)]).stdout == ""  # a top-level folder: its name, empty


def test_only_the_os_folders_show(ws):
    inside = set(ws.exec("ls -A /").stdout.split())
    assert {"usr", "etc", "var", "bin", "proc", "sys", "dev", "tmp", "run", "root"} <= inside
    for name in sorted(inside - images.SHOWN_TOP - {".bunshin"}):
        listing = ws.exec(["ls", "-A", f"/{name}"]).stdout.split()
        allowed = {"proc": None, "sys": None, "dev": None, "run": {"bunshin"}, "tmp": None}
        if name in allowed:
            assert allowed[name] is None or set(listing) <= allowed[name], (name, listing)
            continue
        assert listing == [], (name, listing)  # /root, /home, /work, /opt, /srv, /mnt... are empty
    for sub in ("lib", "log", "cache", "backups", "mail", "spool", "tmp", "opt", "local"):
        assert ws.exec(["ls", "-A", f"/var/{sub}"]).stdout == "", sub
    assert ws.exec(["stat", "-c", "%a", "/var/tmp"]).stdout.strip() == "1777"
    assert ws.exec("echo hi > /var/tmp/x && cat /var/tmp/x").stdout == "hi\n"


def test_etc_secrets_are_empty(ws):
    host = hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest()
    inside = ws.exec(["sha256sum", "/etc/shadow"]).stdout.split()[0]
    assert inside != host and inside == hashlib.sha256(b"").hexdigest()
    for path in ("/etc/gshadow", "/etc/shadow-", "/etc/machine-id"):
        if Path(path).exists():
            assert ws.exec(["wc", "-c", path]).stdout.split()[0] == "0", path
    assert ws.exec("ls -A /etc/ssl/private 2>/dev/null").stdout == ""
    assert ws.exec("ls /etc/ssh/ssh_host_*_key 2>/dev/null | xargs -r cat").stdout == ""
    assert "root:" in ws.exec(["cat", "/etc/passwd"]).stdout  # the rest of /etc shows


def test_bunshin_and_the_checkout_are_invisible(ws):
    for path in (ws.config.db_path, ws.config.home, "/opt/bunshin", "/opt/bunshin/criu/bin/criu",
                 REPO / "README.md", "/var/lib/bunshin", ws.config.tmpfs):
        assert gone(ws, path), path


def test_programs_still_work(ws):
    assert ws.exec(["/usr/bin/python3", "-c", "print(6 * 7)"]).stdout == "42\n"
    for cmd in ("bash -c 'echo $BASH_VERSION'", "ls /usr/bin | wc -l", "sort --version", "pip --version"):
        r = ws.exec(cmd, timeout=60)
        assert r.exit_code == 0, (cmd, r)
    r = ws.exec("python3 -m venv /work/v && /work/v/bin/pip --version", timeout=120)
    assert r.exit_code == 0 and "pip" in r.stdout, r
    if shutil.which("git", path="/usr/bin"):
        assert ws.exec("git --version").exit_code == 0


def test_mask_layer_follows_the_host(cfg, canaries):
    folder, top_file, _ = canaries
    entries = {e.path: e for e in images.mask_entries(cfg)}
    assert entries[folder].kind == "empty" and entries[top_file].kind == "whiteout"
    layer = images.mask_layer(cfg)
    assert os.getxattr(layer / folder.name, "trusted.overlay.opaque") == b"y"
    st = os.lstat(layer / top_file.name)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert layer == images.mask_layer(cfg)  # built once per content
    folder.rmdir() if not any(folder.iterdir()) else shutil.rmtree(folder)
    assert images.mask_layer(cfg) != layer  # another host, another layer


def test_a_home_under_a_shown_folder_is_hidden(cfg):
    """A BUNSHIN_HOME inside /usr: hidden, and the folders on the way keep the host's modes."""
    home = Path(f"/usr/local/lib/bunshin-canary-home-{secrets.token_hex(4)}")
    other = Config.for_home(home, criu=cfg.criu)
    try:
        with Workspace.create("host", memory="256M", pids=64, config=other) as w:
            assert other.db_path.exists() and gone(w, other.db_path)
            assert w.exec(["ls", "-A", str(home)]).stdout == ""  # an empty folder
            assert w.exec(["stat", "-c", "%a %u", "/usr/local/lib"]).stdout.split() == \
                [f"{stat.S_IMODE(os.stat('/usr/local/lib').st_mode):o}", "0"]
            assert w.exec(["/usr/bin/python3", "-c", "print(1)"]).stdout == "1\n"
        assert leftovers(other) == {}
    finally:
        drop_state_tmpfs(other)
        shutil.rmtree(home, ignore_errors=True)
