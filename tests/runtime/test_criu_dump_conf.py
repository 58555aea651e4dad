"""The configuration file a fork's dump over RPC applies: written once, host-only, put back
when changed; a dump with it records file sizes, no build-ids, and its clone restores."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bunshin.runtime.criu import dump_conf as criu_dump_conf
from bunshin.runtime.criu import run as criu
from bunshin.runtime.memfile import criu_images
from bunshin.runtime.snapshot import taking as rsnap_taking

from .test_criu import Counters, criu_bin, workdir  # noqa: F401 (fixtures)


def test_written_once_host_only_and_put_back_when_changed(tmp_path):
    folder = tmp_path / "helpers"
    path = criu_dump_conf.ensure(folder)
    assert path.parent == folder and path.read_text() == criu_dump_conf.OPTIONS
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    inode = path.stat().st_ino
    assert criu_dump_conf.ensure(folder) == path and path.stat().st_ino == inode  # not rewritten
    path.write_text("action-script /tmp/evil.sh\n")
    criu_dump_conf.ensure(folder)
    assert path.read_text() == criu_dump_conf.OPTIONS
    assert sorted(p.name for p in folder.iterdir()) == [criu_dump_conf.NAME]  # no temporary left


@pytest.fixture
def counters(criu_bin: Path, workdir: Path):  # noqa: F811
    c = Counters(workdir)
    yield c
    c.close()


@pytest.mark.criu
def test_a_dump_with_it_stores_sizes_not_build_ids_and_restores(counters, criu_bin, workdir, tmp_path):  # noqa: F811
    pid = counters.spawn()
    conf = criu_dump_conf.ensure(tmp_path / "helpers")
    for name, rpc_config in (("plain", None), ("sized", conf)):
        criu.dump(criu_bin, pid, workdir / name, extra=[*rsnap_taking._COMMON], notify={}, rpc_config=rpc_config)
        regs = [e["reg"] for e in criu_images.load(workdir / name / "files.img")["entries"] if "reg" in e]
        assert regs and any("size" in r for r in regs)
        with_id = [r for r in regs if r.get("build_id")]
        assert (len(with_id) > 0) == (rpc_config is None), name  # the interpreter and its libraries have one
    r = criu.restore(criu_bin, workdir / "sized", pidfile=workdir / "clone.pid")
    assert r.pid is not None
    counters.pids.append(r.pid)
    assert counters.wait_above(r.pid, 0)
