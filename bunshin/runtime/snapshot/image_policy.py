"""What a CRIU image set may bring back on this host: the checks a loaded snapshot passes.

``criu restore`` runs as host root and does what the images say. Images bunshin
dumped itself always describe a workspace: one user namespace mapped to the
config's unprivileged range, the mounts the launcher makes (the overlay root and
binds of it, proc, devpts, the host-made /sys as an external mount) and
bunshin's seccomp filter. A snapshot folder from elsewhere is untrusted input
(``folder_load.load``): its images must describe exactly that, or an edited image
would restore tasks outside any user namespace (root on the host), with a map
onto host root, or with a mount of the host's disk.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import InvalidArgument
from ..container import seccomp
from ..criu import netns_image
from ..memfile import criu_images

# mountpoints FsType numbers (criu/include/fs-magic.h order in images/mnt.proto)
FS_PROC, FS_SYSFS, FS_DEVPTS, FS_OVERLAY = 1, 2, 6, 17
EXTERNAL_PREFIX = "bunshin-"  # the external mounts a restore passes (/sys, shared folders)


def check(images: Path, cfg: Config) -> None:
    """Refuse (InvalidArgument) an image set that is not a bunshin workspace of ``cfg``."""
    try:
        _check_user_namespace(images, cfg)
        _check_network_namespace(images, cfg)
        _check_mounts(images)
        _check_seccomp(images)
    except InvalidArgument:
        raise
    except Exception as e:  # unreadable or malformed images
        raise InvalidArgument(f"the CRIU images in {images} are damaged ({type(e).__name__}: {e})",
                              hint="save the snapshot again with `bunshin snapshot save`") from e


def _refuse(images: Path, why: str) -> InvalidArgument:
    return InvalidArgument(f"the CRIU images in {images} {why}",
                           hint="only images bunshin dumped can be restored; save the snapshot again")


def _entries(path: Path) -> list[dict[str, Any]]:
    return list(criu_images.load(path)["entries"])


def _check_user_namespace(images: Path, cfg: Config) -> None:
    ids = sorted(images.glob("ids-*.img"))
    if not ids:
        raise _refuse(images, "name no task")
    user_ns = {int(e["user_ns_id"]) for f in ids for e in _entries(f) if "user_ns_id" in e}
    if len(user_ns) != 1 or any("user_ns_id" not in e for f in ids for e in _entries(f)):
        raise _refuse(images, "do not put every task in one user namespace")
    userns = images / f"userns-{user_ns.pop()}.img"
    if not userns.is_file():
        raise _refuse(images, "restore tasks outside a user namespace (they would be root on the host)")
    want = [{"first": 0, "lower_first": cfg.id_base, "count": cfg.id_count}]
    for entry in _entries(userns):
        for key in ("uid_map", "gid_map"):
            got = [{k: int(m[k]) for k in ("first", "lower_first", "count")} for m in entry.get(key, [])]
            if got != want:
                raise _refuse(images, f"map the user namespace's ids onto {got} instead of {want}")


def _check_network_namespace(images: Path, cfg: Config) -> None:
    """A restore makes the namespace the images describe (links, addresses, routes,
    rules, tables: CRIU runs ``ip`` and nft on them): only what ``netns_image.add``
    writes for this dump (lo, the groups' ping range, CRIU's lock), or nothing."""
    found = {f.name: f for f in images.iterdir() if netns_image.NET_IMAGE.fullmatch(f.name)}
    if not found:
        return
    net = netns_image.tree_netns(images)
    run_id = str(_entries(images / "inventory.img")[0].get("dump_criu_run_id", ""))
    want = netns_image.expected(net, run_id, cfg.id_count)
    for name, path in sorted(found.items()):
        content = want.get(name)
        if content is None or (path.read_text() if isinstance(content, str) else criu_images.load(path)) != content:
            raise _refuse(images, f"describe a network namespace of their own ({name}) other than a workspace's")


def _check_mounts(images: Path) -> None:
    for f in sorted(images.glob("mountpoints-*.img")):
        entries = _entries(f)
        roots = [e for e in entries if e.get("mountpoint") == "/"]
        if len(roots) != 1 or roots[0]["fstype"] != FS_OVERLAY:
            raise _refuse(images, "do not have the workspace's overlay as their root")
        for e in entries:
            fstype, point = e["fstype"], e.get("mountpoint", "")
            if fstype == FS_OVERLAY and e.get("options") == roots[0].get("options"):
                continue  # the root, and binds of paths inside it (masks)
            if fstype in (FS_PROC, FS_DEVPTS):
                continue
            if e.get("ext_key", "").startswith(EXTERNAL_PREFIX):
                continue  # supplied by the restore itself
            raise _refuse(images, f"mount a filesystem of type {fstype} at {point!r}")


def _check_seccomp(images: Path) -> None:
    """Every task (thread-group leader) runs under a filter chain holding bunshin's."""
    path = images / "seccomp.img"
    want = seccomp.program()
    filters = [e for entry in (_entries(path) if path.is_file() else []) for e in entry.get("seccomp_filters", [])]
    for item in _entries(images / "pstree.img"):
        core = _entries(images / f"core-{int(item['pid'])}.img")[0].get("thread_core", {})
        if core.get("seccomp_mode") not in ("filter", 2):
            raise _refuse(images, f"restore task {item['pid']} without bunshin's seccomp filter")
        index, seen = core.get("seccomp_filter"), set()
        while index is not None and int(index) < len(filters) and int(index) not in seen:
            seen.add(int(index))
            flt = filters[int(index)]
            data = flt["filter"]
            if (base64.b64decode(data) if isinstance(data, str) else bytes(data)) == want:
                break
            index = flt.get("prev")
        else:
            raise _refuse(images, f"restore task {item['pid']} without bunshin's seccomp filter")
