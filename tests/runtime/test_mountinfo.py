"""The one mountinfo parser: real lines (optional fields, none, escapes) and a real mount whose
path holds a space."""

from __future__ import annotations

import os

import pytest

from bunshin.runtime.container import lifecycle as container
from bunshin.runtime.container import statefs
from bunshin.runtime.kernel import mountinfo
from bunshin.runtime.kernel import syscalls as sc

# Lines as this kernel writes them (proc(5)), escapes included.
ROOT = "29 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,discard,errors=remount-ro"
SHM = "25 24 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683656k,inode64"
SPACED = (r"812 29 0:97 / /tmp/with\040space\011tab rw,relatime shared:402 master:7 - tmpfs "
          r"my\040src rw,size=1024k,huge=advise")
BIND = r"90 29 252:1 /srv/back\134slash /mnt/b rw - ext4 /dev/vda1 rw"


def test_fields_of_a_line_with_an_optional_field():
    m = mountinfo.MountEntry.parse(ROOT + "\n")
    assert (m.mount_id, m.parent_id, m.major, m.minor) == (29, 1, 252, 1)
    assert (m.root, m.mount_point, m.options, m.optional) == ("/", "/", "rw,relatime", ("shared:1",))
    assert (m.fs_type, m.source, m.super_options) == ("ext4", "/dev/vda1", "rw,discard,errors=remount-ro")


def test_a_line_without_optional_fields():
    m = mountinfo.MountEntry.parse(SHM)
    assert m.optional == () and m.mount_point == "/dev/shm" and m.fs_type == "tmpfs"
    assert m.super_options == "rw,size=24683656k,inode64"


def test_octal_escapes_are_decoded():
    m = mountinfo.MountEntry.parse(SPACED)
    assert m.mount_point == "/tmp/with space\ttab" and m.source == "my src"
    assert m.optional == ("shared:402", "master:7") and m.super_options == "rw,size=1024k,huge=advise"
    assert mountinfo.MountEntry.parse(BIND).root == "/srv/back\\slash"


@pytest.mark.parametrize("line", ["", "29 1 252:1 / / rw", "x 1 252:1 / / rw - ext4 /dev/vda1 rw"])
def test_malformed_lines_are_refused(line):
    with pytest.raises(ValueError):
        mountinfo.MountEntry.parse(line)


def test_holds():
    m = mountinfo.MountEntry.parse(SHM)
    assert m.holds("/dev/shm") and m.holds("/dev/shm/bunshin/x")
    assert not m.holds("/dev") and not m.holds("/dev/shmx")
    assert mountinfo.MountEntry.parse(ROOT).holds("/anything")


def test_this_process_mounts_parse():
    mounts = mountinfo.read()
    assert any(m.mount_point == "/" for m in mounts)
    assert any(m.mount_point == "/proc" and m.fs_type == "proc" for m in mounts)


@pytest.mark.integration
def test_a_real_mount_with_a_space_in_its_path(tmp_path):
    folder = tmp_path / "a b\tc"
    folder.mkdir()
    sc.mount("none", str(folder), "tmpfs", 0, "size=1m")
    try:
        found = mountinfo.at(folder)
        assert found is not None and found.fs_type == "tmpfs" and "size=1024k" in found.super_options
        assert container.is_mounted(str(folder)) and statefs.options(folder) == found.super_options
        assert os.path.realpath(folder) in statefs.mounts_under(tmp_path)
    finally:
        sc.umount(str(folder))
    assert mountinfo.at(folder) is None and not container.is_mounted(str(folder))


def test_fs_type_of_is_the_deepest_mount_holding_the_path():
    assert mountinfo.fs_type_of("/proc/self/status") == "proc"
    assert mountinfo.fs_type_of("/proc") == "proc"
    assert mountinfo.fs_type_of("/dev/shm") == "tmpfs"
    root = next(m for m in reversed(mountinfo.read()) if m.mount_point == "/")
    assert mountinfo.fs_type_of("/") == root.fs_type
