"""Build an image from a Dockerfile through buildah (Debian's), then load it.

``buildah bud`` runs in a private storage of the store's staging folder, with
``--isolation oci`` (runc) and a user namespace mapping the build's ids onto the
workspaces' range (``Config.id_base``..): a ``RUN`` step is root only inside it, as in a
workspace, never host root. A Dockerfile is untrusted input (a dataset's), so ``RUN``
steps get no network by default (``none``: a network namespace of their own holding only
its loopback); ``host`` (the host's namespace: every service on its loopback, as
``docker build --network host``) only when asked, with a warning. ``egress`` (a private
namespace that reaches out only, as docker's default bridge) is refused by name: it
needs netavark or slirp4netns/pasta, which bunshin does not set up. The result is pushed
to an OCI layout and loaded like any other (``store.load``: every digest checked,
layers unpacked safely, the image's caps applied); the staging folder, buildah's
storage included, is removed whatever happens. That storage (the base image, what
RUN steps write) may use twice the image's size cap (``caps.Watch``: buildah is killed
past it, within a second), so a step that writes without end cannot fill the disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil

from ...config import Config
from ...errors import HostUnsupported, InvalidArgument, PayloadTooLarge, RuntimeFailure
from ..kernel import mountinfo
from ..kernel import syscalls as sc
from ..state.store import Store
from . import caps
from . import store as oci_store
from .records import ImageRecord

BUILDAH = "buildah"
BUILD_TIMEOUT_S = 3 * 3600.0
# buildah's storage holds the base image and a RUN step's writes twice (the container's
# upper and the committed layer): the build may use twice the image's cap of disk
STORAGE_FACTOR = 2
WATCH_S = 1.0
NETWORKS = ("none", "host")
NOT_YET = {"egress": "a private network namespace with egress", "private": "buildah's private network"}
HOST_WARNING = ("RUN steps share the host's network namespace (--network host): the Dockerfile reaches every "
                "service on the host's loopback and network; build only Dockerfiles you trust this way")
log = logging.getLogger("bunshin.image")


def build(cfg: Config, store: Store, context: Path, *, dockerfile: str = "Dockerfile", tags: tuple[str, ...] = (),
          network: str = "none", progress: oci_store.Progress = oci_store.quiet,
          warn: oci_store.Progress = log.warning) -> ImageRecord:
    """Build ``context``'s Dockerfile; the stored image (named ``tags``). ``network``: the
    RUN steps' (``none``, or ``host`` with ``warn`` told ``HOST_WARNING``)."""
    context = Path(context).absolute()
    check_network(network)
    if shutil.which(BUILDAH) is None:
        raise HostUnsupported("buildah is not installed", hint="run `make install` (Debian's buildah builds images)")
    if not context.is_dir():
        raise InvalidArgument(f"build context {context} is not a folder", hint="give the folder holding the Dockerfile")
    if not (context / dockerfile).is_file():
        raise InvalidArgument(f"no {dockerfile} in {context}", hint="write one, or name it with -f")
    if network == "host":
        warn(HOST_WARNING)
    tags = tuple(oci_store.normalize_name(t) for t in tags)
    cfg.paths.image_staging.mkdir(parents=True, exist_ok=True)
    os.chmod(cfg.paths.images, 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cfg.paths.image_staging))
    base = [BUILDAH, "--root", str(tmp / "storage"), "--runroot", str(tmp / "run")]
    # a name of our own, not the folder's: mkdtemp's letters ("_" at an end) are no valid reference
    name = f"localhost/bunshin-build/build-{secrets.token_hex(8)}:latest"
    ids = f"0:{cfg.id_base}:{cfg.id_count}"
    cap = caps.max_bytes(cfg)
    try:
        _run([*base, "bud", "--isolation", "oci", "--userns-uid-map", ids, "--userns-gid-map", ids,
              "--network", network, "--layers=false", "-f", str(context / dockerfile), "-t", name, str(context)],
             "build", progress, (tmp, cap))
        _run([*base, "push", "--quiet", name, f"oci:{tmp / 'out'}"], "export", progress)
        # buildah's layers hold the ids as the build's user namespace wrote them (host
        # ids id_base + N): counted back from id_base
        (rec,) = oci_store.load(cfg, store, tmp / "out", tags=tags, progress=progress, mapped_from=cfg.id_base)
        return rec
    finally:
        subprocess.run([*base, "rmi", "--all", "--force"], capture_output=True, timeout=120, check=False)
        for target in sorted(mountinfo.below(os.path.realpath(tmp) + "/"), key=len, reverse=True):
            try:
                sc.umount(target, sc.MNT_DETACH)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it: runc and the RUN step's container init too
    (killing buildah alone leaves them running; the init's pid namespace dies with it)."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def check_network(network: str) -> None:
    """Refuse a network mode other than ``NETWORKS``; ``egress`` by name."""
    if network in NOT_YET:
        raise InvalidArgument(f"network {network!r} ({NOT_YET[network]}) is not supported yet: it needs netavark "
                              "or slirp4netns/pasta, which bunshin does not set up",
                              hint="use --network none (the default: fetch what the build needs into the "
                                   "context), or --network host for a Dockerfile you trust")
    if network not in NETWORKS:
        raise InvalidArgument(f"network {network!r} is not one of {', '.join(NETWORKS)}",
                              hint="--network none (the default) or host")


def _run(argv: list[str], what: str, progress: oci_store.Progress, watch: tuple[Path, int] | None = None) -> None:
    """Run buildah; with ``watch`` (the staging folder, the image size cap) killed once its
    storage passes twice the cap (``STORAGE_FACTOR``)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def kill() -> None:
            _kill_tree(proc.pid)

        folder, cap = watch if watch is not None else (None, 0)
        with caps.Watch(proc, folder, STORAGE_FACTOR * cap, WATCH_S, kill) as watched:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    log.write(line)
                    if line.strip():
                        progress(line.rstrip())
                proc.wait(timeout=BUILD_TIMEOUT_S)
            except BaseException:
                kill()
                proc.wait()
                raise
        if watched.over is not None:
            raise PayloadTooLarge(f"the build's storage (its base image, what RUN steps wrote) passed "
                                  f"{STORAGE_FACTOR} x the image size cap image_max_bytes={cap} bytes "
                                  f"({cap / (1 << 30):.4g} GiB): stopped, nothing was stored", hint=caps.BYTES_HINT)
        if proc.returncode == 0:
            return
        log.seek(0)
        tail = "\n".join(log.read().strip().splitlines()[-12:])
    if what == "build":
        raise InvalidArgument(f"the image build failed (buildah exited {proc.returncode}):\n{tail}",
                              hint="fix the Dockerfile step shown above; nothing was stored")
    raise RuntimeFailure(f"buildah could not {what} the image (exit {proc.returncode}):\n{tail}")
