"""``idmap.is_mounted``: the quick check a view is up, without reading mountinfo."""

from __future__ import annotations

import subprocess

import pytest

from bunshin.runtime.container import idmap
from bunshin.runtime.kernel import syscalls as sc

pytestmark = pytest.mark.integration


def test_a_bind_within_one_filesystem_is_seen_and_a_symlink_is_not_followed(tmp_path):
    layer, view, link = tmp_path / "layer", tmp_path / "view", tmp_path / "link"
    layer.mkdir()
    view.mkdir()
    assert not idmap.is_mounted(view) and not idmap.is_mounted(tmp_path / "missing")
    sc.mount(str(layer), str(view), None, sc.MS_BIND)  # same filesystem: os.path.ismount misses it
    try:
        assert idmap.is_mounted(view)
        link.symlink_to(view)
        assert not idmap.is_mounted(link)  # a symlink where a view should be is no view
    finally:
        subprocess.run(["umount", str(view)], check=True)
    assert not idmap.is_mounted(view)
