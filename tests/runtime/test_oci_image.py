"""OCI/Docker images end to end on the real runtime (issue 11): one image built here
(busybox-static base, a layer that adds files, a layer that deletes one and makes a
folder opaque) loaded as an OCI layout, an OCI archive (.tar.gz, .tar.zst) and a
``docker save`` archive (skopeo's), sharing every layer; workspaces on it honour
Env, WorkingDir, User, Entrypoint and Cmd; a SWE-style image (Debian's python3
and a project with its tests in a layer) runs its tests in a fork and a fork of a fork.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bunshin.config import Config
from bunshin.errors import ImageNotFound
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.runtime.upkeep import gc
from bunshin.workspace import Workspace

from . import oci_images as oi

pytestmark = pytest.mark.integration

CONFIG = {"Env": ["FOO=bar baz", "PATH=/usr/bin:/bin"], "WorkingDir": "/work", "User": "app",
          "Cmd": ["sleep", "1001"]}


def image_layers() -> list[oi.Layer]:
    upper = (oi.Layer().add("data", "dir").add("data/keep", "file", "kept\n").add("data/gone", "file", "g\n")
             .add("opq", "dir").add("opq/lower", "file", "lower\n").add("data/keep2", "hardlink", "data/keep"))
    top = (oi.Layer(compress="none").add("data/gone", "whiteout").add("opq", "opaque").add("opq/upper", "file", "up\n")
           .add("work", "dir", None, 0o755, 1000).add("setuid", "file", b"x", 0o4755, 0))
    return [oi.busybox_base(), upper, top]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("oci")
    info = oi.build_layout(root / "layout", image_layers(), config=CONFIG)
    out = {"layout": root / "layout", "docker": oi.docker_archive(root / "layout", root / "docker.tar", "test/img:v1"),
           "oci_tar": oi.oci_archive(root / "layout", root / "oci.tar")}
    out["oci_gz"] = oi.compress(out["oci_tar"], "gz")
    out["docker_zst"] = oi.compress(out["docker"], "zst")
    out["info"] = info  # type: ignore[assignment]
    return out


@pytest.fixture
def home(tmp_path: Path):
    """A private home: its store starts empty."""
    cfg = Config.for_home(tmp_path / "home")
    with Store.open(cfg.db_path) as store:
        yield cfg, store


def test_every_format_loads_the_same_image_and_shares_its_layers(built, home) -> None:
    cfg, store = home
    ids = set()
    for kind in ("layout", "docker", "oci_tar", "oci_gz", "docker_zst"):
        (rec,) = oci_store.load(cfg, store, built[kind], tags=[f"fmt/{kind.replace('_', '-')}:1"])
        ids.add(rec.id)
        assert rec.config.user == "app" and rec.config.cmd == ("sleep", "1001")
    assert len(ids) == 1, "the config (and so the image id) is the same whatever the format"
    (rec,) = oci_store.list_images(store)
    assert rec.id == built["info"]["config"]  # type: ignore[index]
    assert list(rec.layers) == built["info"]["diff_ids"]  # type: ignore[index]
    assert oci_store.stored_layers(cfg) == sorted(rec.layers), "three layers stored once for five loads"
    assert "docker.io/test/img:v1" in rec.names and "docker.io/fmt/docker-zst:1" in rec.names
    assert list(cfg.paths.image_staging.iterdir()) == [], "no staging left behind"
    # a layer is on disk with the ids shifted into the workspaces' range, whiteouts as overlayfs's
    top = cfg.paths.image_layer(rec.layers[-1])
    assert (top / "work").stat().st_uid == cfg.id_base + 1000
    gone = (top / "data" / "gone").lstat()
    assert gone.st_rdev == 0 and (gone.st_mode & 0o170000) == 0o020000
    import os

    assert os.getxattr(top / "opq", "trusted.overlay.opaque") == b"y"
    assert (top / "setuid").stat().st_mode & 0o7777 == 0o4755 and (top / "setuid").stat().st_uid == cfg.id_base
    oci_store.remove(store, rec.id)
    assert gc.free_image_layers(cfg, store) and oci_store.stored_layers(cfg) == []
    with pytest.raises(ImageNotFound):
        oci_store.find(store, "test/img:v1")


@pytest.fixture
def image(built, cfg: Config, no_leaks):
    """The test image loaded into the session's home (removed after)."""
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, built["docker"])
    yield rec
    with Store.open(cfg.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(cfg, store)


def test_workspace_on_an_image_sees_its_layers_and_config(image, cfg: Config) -> None:
    with Workspace.create("test/img:v1", memory="256M", config=cfg) as ws:
        r = ws.exec("id -u; id -g; id -G; pwd; echo \"$FOO|$HOME|$PATH\"; ls /data; ls /opq; cat /data/keep")
        assert r.exit_code == 0, r
        assert r.stdout.split("\n") == ["1000", "1000", "1000 50", "/work", "bar baz|/home/app|/usr/bin:/bin",
                                         "keep", "keep2", "upper", "kept", ""], r.stdout
        assert ws.exec("test -e /data/gone").exit_code == 1, "deleted in the top layer"
        assert ws.exec("test -e /opq/lower").exit_code == 1, "hidden by the opaque folder"
        procs = ws.exec("ps -o user,args").stdout
        assert any(line.split()[:3] == ["app", "sleep", "1001"] for line in procs.splitlines()), procs
        # the user cannot write what the image's root owns; a request's env and cwd still win
        assert ws.exec("touch /data/x").exit_code != 0
        r = ws.exec("echo $FOO; pwd", env={"FOO": "mine"}, cwd="/tmp")
        assert r.stdout == "mine\n/tmp\n"


def test_entrypoint_prefixes_the_command_as_docker_run(built, tmp_path: Path, cfg: Config, no_leaks) -> None:
    layout = tmp_path / "ep"
    oi.build_layout(layout, [oi.busybox_base()], config={"Entrypoint": ["sleep"], "Cmd": ["1002"]})
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, layout, tags=["test/ep:1"])
    try:
        with Workspace.create("test/ep:1", memory="256M", config=cfg, command=["1003"]) as ws:
            procs = ws.exec("ps -o user,args").stdout
            assert "sleep 1003" in procs and "1002" not in procs, procs
            assert ws.exec("id -u; pwd").stdout == "0\n/\n", "no User: root; no WorkingDir: /"
        with Workspace.create("test/ep:1", memory="256M", config=cfg) as ws:
            assert "sleep 1002" in ws.exec("ps -o args").stdout
        oi.build_layout(tmp_path / "wd", [oi.busybox_base()], config={"WorkingDir": "/not/in/the/image"})
        with Store.open(cfg.db_path) as store:
            (wd,) = oci_store.load(cfg, store, tmp_path / "wd", tags=["test/wd:1"])
        with Workspace.create("test/wd:1", memory="256M", config=cfg) as ws:
            assert ws.exec("pwd").stdout == "/not/in/the/image\n", "a missing WorkingDir is made, as docker does"
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, wd.id)
    finally:
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)


def test_layers_in_use_survive_image_rm_until_nothing_uses_them(image, built, cfg: Config) -> None:
    ws = Workspace.create(image.id[:19], memory="256M", config=cfg)
    try:
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, image.id)
            assert gc.free_image_layers(cfg, store) == [], "the workspace stacks them"
        assert ws.exec("cat /data/keep").stdout == "kept\n"
    finally:
        ws.remove()
    with Store.open(cfg.db_path) as store:
        assert len(gc.collect(cfg, store).image_layers) == 3
        assert oci_store.stored_layers(cfg) == []
        (again,) = oci_store.load(cfg, store, built["layout"])  # for the fixture to remove
    assert again.id == image.id


SWE_TESTS = '''import unittest
from calc import add

class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

if __name__ == "__main__":
    unittest.main()
'''


@pytest.fixture
def swe_image(tmp_path: Path, cfg: Config, no_leaks):
    """A SWE-style image: busybox, Debian's python3, a project with a bug and its tests."""
    project = (oi.Layer().add("repo", "dir", None, 0o755, 1000)
               .add("repo/calc.py", "file", "def add(a, b):\n    return a - b\n", 0o644, 1000)
               .add("repo/test_calc.py", "file", SWE_TESTS, 0o644, 1000))
    layout = tmp_path / "swe"
    oi.build_layout(layout, [oi.busybox_base(), oi.python_layer(), project],
                    config={"WorkingDir": "/repo", "User": "app", "Env": ["PYTHONDONTWRITEBYTECODE=1"]})
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, layout, tags=["swe/calc:1"])
    yield rec
    with Store.open(cfg.db_path) as store:
        oci_store.remove(store, rec.id)
        gc.free_image_layers(cfg, store)


def test_swe_image_runs_its_tests_in_a_fork_and_a_fork_of_a_fork(swe_image, cfg: Config) -> None:
    test = "python3 -m unittest -q test_calc 2>&1; echo rc=$?"
    with Workspace.create("swe/calc:1", memory="512M", config=cfg) as ws:
        assert "rc=1" in ws.exec(test, timeout=60).stdout, "the bug fails the test"
        (fork,) = ws.fork(1)
        try:
            fork.files.write("/repo/calc.py", "def add(a, b):\n    return a + b\n")
            assert ws.exec("whoami", timeout=10).stdout == "app\n"
            out = fork.exec(test, timeout=60).stdout
            assert "rc=0" in out, out
            (grandchild,) = fork.fork(1)
            try:
                out = grandchild.exec(test + "; id -un; pwd", timeout=60).stdout
                assert "rc=0" in out and out.endswith("app\n/repo\n"), out
            finally:
                grandchild.remove()
        finally:
            fork.remove()
        assert "rc=1" in ws.exec(test, timeout=60).stdout, "the parent still has the bug"


def test_saved_snapshot_names_image_layers_and_loads_where_they_are(image, built, cfg: Config,
                                                                      tmp_path: Path) -> None:
    from bunshin.errors import ImageNotFound as Missing
    from bunshin.workspace import Snapshot

    folder = tmp_path / "saved"
    with Workspace.create("test/img:v1", memory="256M", config=cfg) as ws:
        ws.exec("echo from-the-parent > /work/note")
        snap = ws.snapshot()
        try:
            snap.save(folder)
        finally:
            snap.remove()
    manifest = __import__("json").loads((folder / "snapshot.json").read_text())
    roles = [e["role"] for e in manifest["layers"]]
    assert roles == ["snapshot", "agent", "image", "image", "image"], roles
    assert [e["name"] for e in manifest["layers"] if e["role"] == "image"] == \
        [d[7:] for d in reversed(image.layers)]
    assert sorted(p.name for p in (folder / "layers").iterdir()) == [manifest["layers"][0]["name"] + ".tar"], \
        "only the snapshot's own layer is copied"
    with Store.open(cfg.db_path) as store:  # a home without the image's layers
        oci_store.remove(store, image.id)
        gc.free_image_layers(cfg, store)
        with pytest.raises(Missing, match="image layers this home lacks") as exc:
            Snapshot.load(folder, config=cfg)
        assert "image pull" in (exc.value.hint or "")
        from bunshin.runtime import snapshot as rsnap

        assert rsnap.list_all(store) == [], "nothing recorded"
        oci_store.load(cfg, store, built["oci_gz"])  # the same image, from another format
    loaded = Snapshot.load(folder, config=cfg)
    try:
        (clone,) = loaded.restore(1)
        try:
            assert clone.exec("cat /work/note; id -un; pwd; echo $FOO").stdout == "from-the-parent\napp\n/work\nbar baz\n"
        finally:
            clone.remove()
    finally:
        loaded.remove()


def test_a_deep_image_stacks_past_mount_options_page(tmp_path: Path, cfg: Config, no_leaks) -> None:
    """70 layers: their paths overflow mount(2)'s one page of options (~30 store paths),
    so the overlay is made with one ``lowerdir+`` per layer; nothing is copied."""
    layers = [oi.busybox_base()] + [oi.Layer(compress="none").add(f"l{i}", "file", f"{i}\n").add("top", "file", f"{i}\n")
                                    for i in range(69)]
    oi.build_layout(tmp_path / "deep", layers)
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, tmp_path / "deep", tags=["test/deep:1"])
    try:
        assert len(":".join(str(p) for p in oci_store.lowers(cfg, rec))) > 4096
        with Workspace.create("test/deep:1", memory="256M", config=cfg) as ws:
            assert ws.exec("cat /l0 /l68 /top; ls / | grep -c '^l'").stdout == "0\n68\n68\n69\n"
            (fork,) = ws.fork(1)
            try:
                assert fork.exec("cat /top").stdout == "68\n"
            finally:
                fork.remove()
    finally:
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)


def test_gc_finishes_a_load_that_crashed(home) -> None:
    """A load killed mid-way leaves a half layer in staging, a pending record naming its
    dead process and perhaps a layer folder without its record: gc removes all three."""
    cfg, store = home
    from bunshin.runtime.oci.store import PENDING_KIND

    cfg.paths.image_staging.mkdir(parents=True)
    half = cfg.paths.image_staging / ".layer-0123456789ab-crash"
    (half / "usr").mkdir(parents=True)
    (half / "usr" / "half-written").write_bytes(b"x" * 4096)
    orphan = cfg.paths.image_layer("sha256:" + "ab" * 32)
    orphan.mkdir(parents=True)
    dead = 2**22 + 12345  # above pid_max: never a live process
    store.put_object(PENDING_KIND, f"{dead}-00000000", "sha256:" + "ab" * 32)
    report = gc.free_image_layers(cfg, store)
    assert str(half) in report and str(orphan) in report
    assert store.list_objects(PENDING_KIND) == [] and oci_store.stored_layers(cfg) == []
    assert list(cfg.paths.image_staging.iterdir()) == []


def test_setuid_bits_are_kept_and_raise_nobody(tmp_path: Path, cfg: Config, no_leaks) -> None:
    """A setuid-root program keeps its bits in the layer (as docker keeps them), owned on the
    host by the unprivileged id_base; inside, every workspace runs with no_new_privs (as
    docker's ``--security-opt no-new-privileges``), so it raises nobody."""
    py = Path("/usr/bin/python3").resolve().read_bytes()
    top = oi.Layer(compress="none").add("usr/bin/python3s", "file", py, 0o4755, 0)
    oi.build_layout(tmp_path / "suid", [oi.busybox_base(), oi.python_layer(), top], config={"User": "app"})
    with Store.open(cfg.db_path) as store:
        (rec,) = oci_store.load(cfg, store, tmp_path / "suid", tags=["test/suid:1"])
    try:
        host_file = cfg.paths.image_layer(rec.layers[-1]) / "usr" / "bin" / "python3s"
        st = host_file.stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (cfg.id_base, 0o4755)
        with Workspace.create("test/suid:1", memory="256M", config=cfg) as ws:
            code = "import os; print(os.getuid(), os.geteuid(), open('/proc/self/status').read().count('CapEff:\\t0000000000000000'))"
            assert ws.exec(["python3s", "-c", code]).stdout == "1000 1000 1\n", "no_new_privs: the bit is ignored"
            assert ws.exec("grep NoNewPrivs /proc/self/status").stdout.split() == ["NoNewPrivs:", "1"]
    finally:
        with Store.open(cfg.db_path) as store:
            oci_store.remove(store, rec.id)
            gc.free_image_layers(cfg, store)


def test_a_shell_session_on_a_busybox_only_image_forks(image, cfg: Config) -> None:
    """No bash in the image: the session is busybox's sh (without job control, which
    CRIU could not dump), its state carried into a fork and a fork of the fork."""
    with Workspace.create("test/img:v1", memory="256M", config=cfg) as ws:
        with ws.shell() as sh:
            assert sh.run("cd /opq; export K=kept; sleep 1000 & echo started").output.endswith("started\n")
            (fork,) = ws.fork(1)
            try:
                sid = ws.sessions.list()[0].session_id
                assert fork.sessions.run(sid, "echo $K $PWD $(id -un)", timeout=10).output == "kept /opq app\n"
                (grand,) = fork.fork(1)
                try:
                    assert grand.sessions.run(sid, "echo $K; jobs | wc -l", timeout=10).output == "kept\n1\n"
                finally:
                    grand.remove()
            finally:
                fork.remove()
