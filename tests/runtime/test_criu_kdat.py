"""CRIU's kernel-feature cache: made where CRIU cannot keep it, loaded by criu, made again when stale."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bunshin.runtime.criu import kdat as criu_kdat

pytestmark = [pytest.mark.integration, pytest.mark.criu]


@pytest.fixture
def private_paths(tmp_path, monkeypatch):
    """The cache's paths moved into the test's folder (criu itself still writes /run only
    inside the private mount namespace ``make`` gives it)."""
    monkeypatch.setattr(criu_kdat, "KDAT", tmp_path / "criu.kdat")
    monkeypatch.setattr(criu_kdat, "STAMP", tmp_path / "criu.kdat.bunshin")
    monkeypatch.setattr(criu_kdat, "_checked", None)
    monkeypatch.setattr(criu_kdat, "run_is_tmpfs", lambda: False)
    return tmp_path


def test_criu_loads_the_cache_bunshin_keeps(cfg, tmp_path):
    if criu_kdat.run_is_tmpfs():
        pytest.skip("/run is a tmpfs here: CRIU keeps its own cache")
    assert criu_kdat.ensure(cfg.criu)
    log = tmp_path / "check.log"
    subprocess.run([str(cfg.criu), "check", "-v4", "-o", str(log)], capture_output=True, check=False, timeout=60)
    assert f"Loaded kdat cache from {criu_kdat.KDAT}" in log.read_text(errors="replace")
    st = criu_kdat.status(cfg.criu)
    assert st.cached and st.managed_by == "bunshin"


def test_a_stale_or_changed_cache_is_made_again(cfg, private_paths):
    assert criu_kdat.ensure(cfg.criu)
    good = criu_kdat.KDAT.read_bytes()
    assert len(good) > 100 and criu_kdat.status(cfg.criu).cached
    # another boot wrote it: made again, with this boot's stamp
    stamp = json.loads(criu_kdat.STAMP.read_text())
    criu_kdat.STAMP.write_text(json.dumps({**stamp, "boot_id": "another-boot"}))
    criu_kdat._checked = None
    assert not criu_kdat.status(cfg.criu).cached
    assert criu_kdat.ensure(cfg.criu)
    assert json.loads(criu_kdat.STAMP.read_text())["boot_id"] == stamp["boot_id"]
    # changed after it was made (one byte): seen by its digest, made again
    bad = bytes([good[0] ^ 0xFF]) + good[1:]
    criu_kdat.KDAT.write_bytes(bad)
    assert not criu_kdat.status(cfg.criu).cached
    assert criu_kdat.ensure(cfg.criu)
    assert criu_kdat.KDAT.read_bytes()[:4] == good[:4] != bad[:4] and criu_kdat.status(cfg.criu).cached


def test_without_a_working_criu_nothing_is_written_and_nothing_raises(private_paths):
    missing = Path(private_paths / "no-such-criu")
    assert criu_kdat.ensure(missing) is False
    assert not criu_kdat.KDAT.exists() and not criu_kdat.STAMP.exists()
    st = criu_kdat.status(missing)
    assert not st.cached and "probes the kernel again" in st.detail
