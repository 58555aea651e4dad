"""Integration: processes that are not root fork and continue as themselves (issue 16).

CRIU reads each task's rlimits with prlimit(2), which needs CAP_SYS_RESOURCE over a task
of another uid; no process on these hosts holds it in the host's user namespace, so plain
CRIU fails on a non-root task ("Can't get rlimit 0: Operation not permitted", ZDTM pid00
and mlock_setuid). A workspace's tasks live in a user namespace the host's root made:
its owner holds every capability in it (user_namespaces(7)), so criu, run by that root,
may. The service is ``progs/ids.c`` (1 MiB mlocked, its ids reported in a file it writes
anew every 50 ms), run three ways: under ``setpriv`` as uid 1000, as root that becomes
uid 1000 mid-run (setresuid after mlock, as mlock_setuid), and as an OCI image's
non-root ``User``. Every clone's copy must report the same ids, keep its memory locked
and intact, and write files owned by that user.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace
from tests.runtime import oci_images as oi
from tests.workspace.test_fork import wait_file

pytestmark = [pytest.mark.integration, pytest.mark.criu]

PROGS = Path(__file__).parent / "progs"
DIR = "/tmp/ids"
APP = "1000 1000 1000 1000 1000 1000"  # ruid euid suid rgid egid sgid


@pytest.fixture(scope="module")
def ids_binary(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    out = tmp_path_factory.mktemp("ids") / "ids"
    subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(PROGS / "ids.c")], check=True)
    return out.read_bytes()


def state(ws: Workspace, folder: str = DIR) -> tuple[str, int, str, int]:
    """(ids, supplementary group count, "vmlck_kib pattern_ok owner UID:GID", counter) of the
    service, the owner being its state file's."""
    r = ws.exec(["sh", "-c", f"cat {folder}/state && stat -c '%u:%g' {folder}/state"])
    assert r.exit_code == 0, r
    line, owner = r.stdout.splitlines()
    f = line.split()
    return " ".join(f[:6]), int(f[6]), f"{f[7]} {f[8]} owner {owner}", int(f[9])


def wait_progress(ws: Workspace, after: int, folder: str = DIR, timeout: float = 20) -> tuple[str, int, str, int]:
    """The service's state once its counter passed ``after`` (it runs, and wrote the file)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            s: tuple[str, int, str, int] | None = state(ws, folder)
        except (AssertionError, ValueError, IndexError):  # between two writes, or not there yet
            s = None
        if s is not None and s[3] > after:
            return s
        assert time.monotonic() < deadline, f"{ws.id}: the service made no progress past {after}: {s}"
        time.sleep(0.05)


def check_clones_continue_as(parent: Workspace, clones: list[Workspace], *, groups: int = 0,
                             folder: str = DIR) -> None:
    """The parent's service runs as uid/gid 1000 with ``groups`` supplementary groups, its
    1 MiB locked and intact, its file owned by 1000:1000; so does every clone's copy, in
    a file it wrote after the fork."""
    before = wait_progress(parent, 0, folder)
    assert before[:3] == (APP, groups, "1024 1 owner 1000:1000"), before
    for c in clones:
        s = wait_progress(c, before[3] + 2, folder)  # written by the clone's own copy after the fork
        assert s[:3] == before[:3], f"{c.id} runs as someone else: {s} (the parent: {before})"
        procs = c.exec(["sh", "-c", "for p in /proc/[0-9]*; do echo $(awk '/^Uid:/ {print $2}' $p/status)"
                        " $(tr '\\0' ' ' < $p/cmdline); done"]).stdout
        assert any(line.split()[:1] == ["1000"] and "ids" in line for line in procs.splitlines()), procs


def test_a_service_started_as_a_non_root_user_forks_as_that_user(family, ids_binary):
    ws = family.create()
    ws.files.write("/root/ids", ids_binary, mode=0o755)
    assert ws.exec(["sh", "-c", f"mkdir -m 777 {DIR} && cp /root/ids /usr/local/bin/ids"]).exit_code == 0
    ws.commands.spawn(["setpriv", "--reuid", "1000", "--regid", "1000", "--clear-groups", "/usr/local/bin/ids", DIR])
    wait_file(ws, f"{DIR}/ready")
    clones = family.fork(ws, 2)
    clones += family.fork(clones[0], 1)  # and a fork of a fork
    check_clones_continue_as(ws, clones)


def test_a_process_that_changed_its_uid_mid_run_with_locked_memory_forks(family, ids_binary):
    ws = family.create()
    ws.files.write("/root/ids", ids_binary, mode=0o755)
    assert ws.exec(["mkdir", "-m", "777", DIR]).exit_code == 0
    ws.commands.spawn(["/root/ids", DIR, "1000"])
    pid = int(wait_file(ws, f"{DIR}/ready"))
    assert ws.exec(["grep", "^Uid:\t0\t", f"/proc/{pid}/status"]).exit_code == 0, "root until told"
    assert ws.exec(["touch", f"{DIR}/go"]).exit_code == 0
    wait_progress(ws, 0)  # it is uid 1000 now
    (a,) = family.fork(ws, 1)
    clones = [a, *family.fork(a, 1)]
    check_clones_continue_as(ws, clones)
    for c in clones:  # the kernel's view too: the same task, its memory still locked
        status = c.exec(["cat", f"/proc/{pid}/status"]).stdout
        assert "Uid:\t1000\t1000\t1000\t1000" in status and "VmLck:\t    1024 kB" in status, status


@pytest.fixture
def app_image(ids_binary: bytes, tmp_path: Path, cfg: Config, no_leaks):
    """An image whose User is the non-root ``app`` (1000, also in group staff) and whose
    command is the service, writing in app's home."""
    service = oi.Layer().add("usr/local", "dir").add("usr/local/bin", "dir").add(
        "usr/local/bin/ids", "file", ids_binary, 0o755)
    config = {"User": "app", "Cmd": ["/usr/local/bin/ids", "/home/app"], "WorkingDir": "/home/app"}
    oi.build_layout(tmp_path / "layout", [oi.busybox_base(), service], config=config)
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, tmp_path / "layout", tags=["test/app-user:1"])
    yield rec
    with Store.open(cfg.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(cfg, store)


def test_an_image_whose_user_is_not_root_forks_as_that_user(app_image, cfg: Config):
    home = "/home/app"
    ws = Workspace.create("test/app-user:1", memory="256M", config=cfg)
    clones: list[Workspace] = []
    try:
        wait_file(ws, f"{home}/ready")
        clones = ws.fork(2)
        clones += clones[0].fork(1)
        # app's groups from the image's /etc/group: 1000 and staff (50)
        check_clones_continue_as(ws, clones, groups=2, folder=home)
        for c in clones:  # and what runs in a clone later runs as the image's User
            r = c.exec("id -u; id -g; id -G; touch by-exec; stat -c '%u:%g' by-exec")
            assert r.stdout.split("\n") == ["1000", "1000", "1000 50", "1000:1000", ""], r
            assert c.exec("touch /etc/not-mine").exit_code != 0, "the image's root files stay root's"
    finally:
        for c in reversed(clones):
            c.remove()
        ws.remove()


def test_su_and_runuser_as_root_work_in_a_workspace_its_clone_and_a_fork_of_it(family):
    """PAM in the workspace's user namespace: root's ``su -c`` (pam_rootok) and ``runuser`` to
    itself and to another user, in the parent, a clone and a fork of a fork."""
    ws = family.create()
    assert ws.exec(["useradd", "-m", "-s", "/bin/sh", "-G", "staff", "pamuser"]).exit_code == 0
    (c,) = family.fork(ws, 1)
    (cc,) = family.fork(c, 1)
    for w in (ws, c, cc):
        for argv, want in ((["su", "-c", "id -un"], "root"), (["su", "-c", "id -un; id -Gn", "pamuser"], "pamuser"),
                           (["su", "-", "pamuser", "-c", "pwd"], "/home/pamuser"),
                           (["runuser", "-u", "pamuser", "--", "id", "-un"], "pamuser")):
            r = w.exec(argv)
            assert r.exit_code == 0 and r.stdout.split("\n")[0] == want, (w.id, argv, r)
        assert "staff" in w.exec(["su", "-c", "id -Gn", "pamuser"]).stdout.split()


@pytest.fixture
def pam_image(tmp_path: Path, cfg: Config, no_leaks):
    """An image with Debian's su, runuser and PAM stack (this host's files: /etc/pam.d, every
    PAM module), root and nobody, and a shadow file of locked passwords."""
    base = oi.Layer()
    for d in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "etc/pam.d", "etc/security", "lib",
              "lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu/security", "root", "tmp", "proc", "sys", "dev"):
        base.add(d, "dir", None, 0o1777 if d == "tmp" else 0o755)
    for f in [*Path("/etc/pam.d").iterdir(), *Path("/etc/security").glob("*.conf"), Path("/etc/login.defs")]:
        base.add(str(f).lstrip("/"), "file", f.read_bytes(), 0o644)
    base.add("etc/passwd", "file", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/usr/sbin/nologin\n")
    base.add("etc/group", "file", "root:x:0:\nnogroup:x:65534:\n")
    base.add("etc/shadow", "file", "root:*:19000:0:99999:7:::\nnobody:*:19000:0:99999:7:::\n", 0o640)
    modules = [str(m) for m in Path("/lib/x86_64-linux-gnu/security").glob("*.so")]
    programs = oi.binaries_layer("/bin/su", "/sbin/runuser", "/usr/bin/id", "/bin/sh", "/usr/sbin/nologin", *modules)
    oi.build_layout(tmp_path / "layout", [base, programs], config={"Cmd": ["/bin/sh", "-c", "exec sleep infinity"]})
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, tmp_path / "layout", tags=["test/pam:1"])
    yield rec
    with Store.open(cfg.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(cfg, store)


def test_su_and_runuser_as_root_work_in_an_image_with_debians_pam(pam_image, cfg: Config):
    """The image's own PAM stack (pam_rootok, pam_unix, pam_limits, pam_env...) in the workspace's
    user namespace: root's ``su`` to itself and to nobody (whose login shell refuses, as on any
    system; then another shell), ``su -``, ``runuser`` (clones: the host image's test above)."""
    ws = Workspace.create("test/pam:1", memory="256M", config=cfg)
    try:
        for argv, want in ((["su", "-c", "id -un"], "root"), (["su", "-", "root", "-c", "id -un"], "root"),
                           (["su", "-s", "/bin/sh", "-c", "id -un", "nobody"], "nobody"),
                           (["runuser", "-u", "nobody", "--", "id", "-un"], "nobody")):
            r = ws.exec(argv)
            assert r.exit_code == 0 and r.stdout.strip() == want, (argv, r)
        r = ws.exec(["su", "-c", "id", "nobody"])  # nobody's shell is nologin: its refusal, not PAM's
        assert r.exit_code == 1 and "currently not available" in r.stdout + r.stderr, r
    finally:
        ws.remove()
