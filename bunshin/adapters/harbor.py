"""Harbor: a ``BaseEnvironment`` whose container is a bunshin workspace, built from the task's Dockerfile.

::

    harbor run -p tasks/ -a oracle -k 8 \\
        --environment-import-path bunshin.adapters.harbor:BunshinEnvironment

A Harbor task's environment is a folder with a ``Dockerfile`` (or ``[environment]
docker_image``). ``start`` builds it with ``bunshin image build`` (buildah, its ``RUN``
steps root only in a user namespace) once per Dockerfile content in the process, tagged
``harbor/<name>:<hash>`` and reused by later runs; the first trial of that environment
starts a workspace from the image and takes a copy-on-write snapshot of it (the root);
every trial of the task, the first included, restores its own workspace from the root.
So Harbor's ``-k`` attempts of one task (its group of trials) share one build, one boot
and the root's memory and files copy-on-write, and each starts from the same state.

``exec`` runs through ``sh -c`` (``cwd``, ``env``, ``timeout_sec``); files and folders
go in and out through the workspace's file API (a folder download copies regular files
and folders only: a symlink planted inside is not followed to the host nor recreated on
it). Workspaces have no network. Options (Harbor's environment kwargs): ``fork`` (default
true; false: a fresh workspace from the image per trial), ``memory`` (default
``[environment] memory_mb``, else 2G), ``build_network`` (``RUN`` steps': ``none`` by
default, ``host`` for a dataset you trust, with a warning: ``oci.build``), ``bunshin_config``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shlex
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.environments.capabilities import EnvironmentCapabilities

from ..config import Config
from ..errors import ImageNotFound, InvalidArgument, ResourceExhausted, StateConflict
from ..runtime.agent_host.types import FileType
from ..runtime.oci import store as oci_store
from ..runtime.state.store import Store
from ..workspace import Workspace
from ..workspace.protocol import SnapshotAPI, WorkspaceAPI
from ._group import GROUPS

ENV_TYPE = "bunshin"
DOCKERFILE = "Dockerfile"
#: Harbor's in-container log folders (agent, verifier, artifacts), made at start.
LOG_DIRS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")
_BUILD_LOCKS: dict[str, threading.Lock] = {}
_BUILD_GUARD = threading.Lock()
#: What one ``download_dir`` copies out of a workspace at most (its tree is hostile).
DOWNLOAD_MAX_DEPTH = 64
DOWNLOAD_MAX_FILES = 100_000
DOWNLOAD_MAX_BYTES = 4 << 30
#: Bytes one read of a download asks (the host holds one piece at a time).
DOWNLOAD_CHUNK = 4 << 20
#: Builds that failed in this process, by tag: a changed Dockerfile is another tag; force_build retries.
_BUILD_FAILED: dict[str, Exception] = {}


def context_hash(folder: Path) -> str:
    """A digest of the build context (every file's path, mode and bytes)."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(folder).as_posix()
        h.update(f"{rel}\0{stat.S_IMODE(path.stat().st_mode):o}\0".encode())
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def image_for(cfg: Config, environment_dir: Path, name: str, *, docker_image: str | None = None,
              force_build: bool = False, network: str = "none") -> str:
    """The stored image of a Harbor environment: ``docker_image`` as named (stored or
    pulled), else the folder's Dockerfile built once per content (``harbor/<name>:<hash>``)."""
    from ..runtime.container.images import stored_image

    if docker_image:
        with Store.open(cfg.db_path) as store:
            return stored_image(cfg, store, docker_image).id
    digest = context_hash(environment_dir)[:16]
    tag = oci_store.normalize_name(f"harbor/{_tag_part(name)}:{digest}")
    with _BUILD_GUARD:
        lock = _BUILD_LOCKS.setdefault(tag, threading.Lock())
    with lock, Store.open(cfg.db_path) as store:
        failed = _BUILD_FAILED.get(tag)
        if failed is not None and not force_build:  # the trials that waited for a failed build fail with it
            raise failed
        if not force_build:
            try:
                return oci_store.find(store, tag).id
            except ImageNotFound:
                pass
        from ..runtime.oci.build import build

        try:
            rec = build(cfg, store, environment_dir, dockerfile=DOCKERFILE, tags=(tag,), network=network)
        except Exception as e:
            _BUILD_FAILED[tag] = e
            raise
        _BUILD_FAILED.pop(tag, None)
        return rec.id


def _tag_part(name: str) -> str:
    out = "".join(c if c.isalnum() or c in "._-" else "-" for c in name.lower()).strip("._-")
    return out[:64] or "task"


class BunshinEnvironment(BaseEnvironment):
    """One Harbor trial's environment: a workspace restored from its task environment's root."""

    def __init__(self, *args: Any, fork: bool = True, memory: str | int | None = None,
                 build_network: str = "none", bunshin_config: Config | None = None, **kwargs: Any) -> None:
        self._fork = bool(fork)
        self._memory = memory
        self._build_network = build_network
        self._cfg = bunshin_config if isinstance(bunshin_config, Config) else Config.from_env()
        self._ws: WorkspaceAPI | None = None
        self.image_id: str | None = None
        self.group_key: str | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return ENV_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        if getattr(self.task_env_config, "docker_image", None):
            return
        if not (Path(self.environment_dir) / DOCKERFILE).is_file():
            raise FileNotFoundError(f"{Path(self.environment_dir) / DOCKERFILE} not found: a bunshin environment "
                                    "builds the task's Dockerfile (or set [environment] docker_image)")

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        if self._ws is not None:
            raise StateConflict(f"environment {self.session_id} is already started", hint="stop it first")
        fut = asyncio.get_running_loop().run_in_executor(None, self._start, force_build)
        try:
            self._ws = await asyncio.shield(fut)
        except asyncio.CancelledError:  # the thread goes on: what it makes is removed when it is done
            fut.add_done_callback(_remove_made)
            raise
        await self._exec_checked("mkdir -p " + " ".join(LOG_DIRS))

    def _start(self, force_build: bool) -> WorkspaceAPI:
        image = image_for(self._cfg, Path(self.environment_dir), self.environment_name,
                          docker_image=getattr(self.task_env_config, "docker_image", None),
                          force_build=force_build, network=self._build_network)
        self.image_id = image
        memory = self._memory or (f"{self.task_env_config.memory_mb}M" if self.task_env_config.memory_mb else "2G")
        if not self._fork:
            return Workspace.create(image, memory=memory, config=self._cfg)
        self.group_key = f"harbor:{image[:24]}:{memory}"

        def build_root() -> SnapshotAPI:
            ws = Workspace.create(image, memory=memory, config=self._cfg)
            try:
                return ws.snapshot()
            finally:
                ws.remove()

        if force_build:
            GROUPS.release(self.group_key)
        (ws,) = GROUPS.restore(self.group_key, build_root)
        return ws

    async def stop(self, delete: bool) -> None:
        """Remove the trial's workspace (always: a bunshin workspace is not kept stopped);
        the root stays for the task's other trials (``release_roots`` frees them)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            await asyncio.to_thread(ws.remove)

    @staticmethod
    def release_roots() -> None:
        """Free every Harbor root this process made (also done at exit)."""
        for key in GROUPS.keys():
            if key.startswith("harbor:"):
                GROUPS.release(key)

    # --- commands -------------------------------------------------------------------------

    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        ws = self._workspace()
        if user is None:
            user = self.default_user
        line = command if user in (None, "root", 0, "0") else f"su -s /bin/sh {shlex.quote(str(user))} -c " \
                                                              f"{shlex.quote(command)}"
        merged = {**(getattr(self, "_persistent_env", None) or {}), **(env or {})}
        workdir = cwd or getattr(self.task_env_config, "workdir", None)
        r = await asyncio.to_thread(ws.exec, ["/bin/sh", "-c", line], cwd=workdir, env=merged or None,
                                    timeout=float(timeout_sec) if timeout_sec else None)
        code = r.exit_code if not r.timed_out else 124
        return ExecResult(stdout=r.stdout, stderr=r.stderr, return_code=code)

    async def _exec_checked(self, command: str) -> None:
        r = await self.exec(command, cwd="/")
        if r.return_code != 0:
            raise StateConflict(f"environment {self.session_id}: {command!r} exited {r.return_code}",
                                hint=(r.stderr or "")[-300:] or None)

    # --- files ----------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        await asyncio.to_thread(self._workspace().files.write, target_path, src.read_bytes(),
                                mode=stat.S_IMODE(src.stat().st_mode))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        src = Path(source_dir)
        if not src.is_dir():
            raise InvalidArgument(f"upload_dir: {src} is not a folder", hint="give a local folder")
        await asyncio.to_thread(self._upload_tree, src, PurePosixPath(target_dir))

    def _upload_tree(self, src: Path, target: PurePosixPath) -> None:
        ws = self._workspace()
        ws.exec(["mkdir", "-p", str(target)])
        for root, dirs, files in os.walk(src):
            rel = Path(root).relative_to(src)
            for d in dirs:
                ws.exec(["mkdir", "-p", str(target / rel.as_posix() / d)])
            for f in files:
                path = Path(root) / f
                if path.is_symlink() or not path.is_file():
                    continue
                ws.files.write(str(target / rel.as_posix() / f), path.read_bytes(),
                               mode=stat.S_IMODE(path.stat().st_mode))

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        dest = Path(target_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(_copy_out, self._workspace(), source_path, dest, DOWNLOAD_MAX_BYTES)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        await asyncio.to_thread(self._download_tree, PurePosixPath(source_dir), Path(target_dir))

    def _download_tree(self, src: PurePosixPath, dest: Path) -> None:
        """Copy regular files and folders (never links or special files) breadth first,
        within ``DOWNLOAD_MAX_DEPTH``, ``DOWNLOAD_MAX_FILES`` and ``DOWNLOAD_MAX_BYTES``."""
        ws = self._workspace()
        todo, files, size = [(src, dest, 0)], 0, 0
        while todo:
            folder, into, depth = todo.pop()
            if depth > DOWNLOAD_MAX_DEPTH:
                raise ResourceExhausted(f"download_dir {src}: folders nest deeper than {DOWNLOAD_MAX_DEPTH} "
                                        f"(at {folder})", hint="download a sub-folder, or tar it inside first")
            into.mkdir(parents=True, exist_ok=True)
            for entry in ws.files.list(str(folder)):
                name = entry.name
                if name in ("", ".", "..") or "/" in name or "\0" in name:
                    continue  # a name no folder listing gives: never a path out of dest
                if entry.type == FileType.DIR:
                    todo.append((folder / name, into / name, depth + 1))
                elif entry.type == FileType.FILE:
                    files, size = files + 1, size + entry.size
                    if files > DOWNLOAD_MAX_FILES or size > DOWNLOAD_MAX_BYTES:
                        raise ResourceExhausted(
                            f"download_dir {src}: over {DOWNLOAD_MAX_FILES} files or {DOWNLOAD_MAX_BYTES} bytes",
                            hint="download a sub-folder, or tar and compress it inside first")
                    size = size - entry.size + _copy_out(ws, str(folder / name), into / name,
                                                         DOWNLOAD_MAX_BYTES - size + entry.size)
                # symlinks and special files stay in the workspace

    def _workspace(self) -> WorkspaceAPI:
        if self._ws is None:
            raise StateConflict(f"environment {self.session_id} is not started", hint="await start(...) first")
        return self._ws


def _remove_made(fut: asyncio.Future[WorkspaceAPI]) -> None:
    """Remove the workspace a cancelled ``start`` made after all."""
    if not fut.cancelled() and fut.exception() is None:
        try:
            fut.result().remove()
        except Exception as e:  # `bunshin ls` shows it; `bunshin rm` removes it
            logging.getLogger("bunshin.adapters").warning("removing an orphaned Harbor workspace failed: %s", e)


def _copy_out(ws: WorkspaceAPI, src: str, dest: Path, most: int) -> int:
    """Copy the workspace's file ``src`` to ``dest`` (replacing what is there without following
    a symlink) a piece at a time, at most ``most`` bytes: a larger file is refused
    (``ResourceExhausted``) and what was copied removed. The bytes copied."""
    if dest.is_symlink():
        dest.unlink()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    got = 0
    try:
        with os.fdopen(fd, "wb") as f:
            while piece := ws.files.read(src, offset=got, length=min(DOWNLOAD_CHUNK, most + 1 - got)):
                got += len(piece)
                if got > most:
                    raise ResourceExhausted(f"download of {src}: over {most} bytes",
                                            hint="download less, or compress it inside first")
                f.write(piece)
                if got == most + 1 or len(piece) < DOWNLOAD_CHUNK:
                    break
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return got
