"""File operations: ``read_file``, ``write_file``, ``list_dir``, ``stat``, ``remove``.

Paths must be absolute. Only regular files are read or written (a FIFO or a
device could block the agent or never end). Paths are walked by ``pathwalk``: none
reaches the agent's own ``/proc`` entries, which processes inside are refused.
"""

from __future__ import annotations

import base64
import binascii
import errno
import os
import stat
from typing import Any

from . import pathwalk
from .protocol import (
    AgentFailure,
    arg_bool,
    arg_int,
    arg_path,
    arg_str,
    from_os_error,
    invalid,
)
from .wire import MAX_CHUNK, ErrorCode, FileType

#: Most bytes one ``read_file`` answers (clients read larger files in chunks).
MAX_READ = MAX_CHUNK


def _type_name(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return FileType.FILE
    if stat.S_ISDIR(mode):
        return FileType.DIR
    if stat.S_ISLNK(mode):
        return FileType.SYMLINK
    return FileType.OTHER


def _entry(name: str, path: str, st: os.stat_result, dir_fd: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "type": _type_name(st.st_mode),
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "mtime": st.st_mtime,
    }
    if stat.S_ISLNK(st.st_mode):
        try:
            entry["link_target"] = os.readlink(path, dir_fd=dir_fd)
        except OSError:
            entry["link_target"] = None
    return entry


def _open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` without blocking on FIFOs; refuse anything but a regular file."""
    try:
        walked = pathwalk.walk(path)
        try:
            fd = walked.reopen(flags | os.O_NONBLOCK, mode)
        finally:
            walked.close()
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO without a reader
            raise invalid(f"{path}: not a regular file") from None
        raise from_os_error(exc, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "is a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise invalid(f"{path}: {kind}")
    os.set_blocking(fd, True)
    return fd


def read_file(req: dict[str, Any]) -> dict[str, Any]:
    path = arg_path(req)
    offset = arg_int(req, "offset", 0)
    length = arg_int(req, "length", MAX_READ)
    if length > MAX_READ:
        raise invalid(f"length {length} exceeds {MAX_READ} bytes per call; read in chunks")
    fd = _open_regular(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunks: list[bytes] = []
        got = 0
        while got < length:
            chunk = os.pread(fd, min(length - got, 1 << 20), offset + got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise from_os_error(exc, path) from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    return {
        "data_b64": base64.b64encode(data).decode("ascii"),
        "size": size,
        "eof": len(data) < length,
    }


def write_file(req: dict[str, Any]) -> dict[str, Any]:
    path = arg_path(req)
    try:
        data = base64.b64decode(arg_str(req, "data_b64"), validate=True)
    except (binascii.Error, ValueError):
        raise invalid('argument "data_b64" is not valid base64') from None
    mode = arg_int(req, "mode", None)
    if mode is not None and mode > 0o7777:
        raise invalid(f"mode {mode:o} is not a permission mode")
    append = arg_bool(req, "append")
    parent = os.path.dirname(path)
    if arg_bool(req, "mkdirs"):
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise from_os_error(exc, parent) from None
    elif not os.path.lexists(parent):
        raise AgentFailure(ErrorCode.PATH_NOT_FOUND, f"{parent}: no such directory (pass mkdirs)")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = _open_regular(path, flags, 0o644 if mode is None else mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if mode is not None:
            os.fchmod(fd, mode)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise from_os_error(exc, path) from None
    finally:
        os.close(fd)
    return {"size": size}


def list_dir(req: dict[str, Any]) -> dict[str, Any]:
    path = arg_path(req)
    entries = []
    try:
        walked = pathwalk.walk(path)
        try:
            if walked.obj < 0:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
            fd = walked.reopen(os.O_RDONLY | os.O_DIRECTORY)
        finally:
            walked.close()
        try:
            with os.scandir(fd) as it:
                for item in it:
                    try:
                        entries.append(_entry(item.name, item.name, item.stat(follow_symlinks=False), fd))
                    except FileNotFoundError:
                        continue  # removed while listing
        finally:
            os.close(fd)
    except NotADirectoryError:
        raise invalid(f"{path}: not a directory") from None
    except OSError as exc:
        raise from_os_error(exc, path) from None
    entries.sort(key=lambda e: e["name"])
    return {"entries": entries}


def stat_op(req: dict[str, Any]) -> dict[str, Any]:
    path = arg_path(req)
    try:
        walked = pathwalk.walk(path, follow_last=False)
        try:
            if walked.obj < 0:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
            st = os.fstat(walked.obj)
            return _entry(os.path.basename(path.rstrip("/")) or "/", walked.name, st, walked.parent)
        finally:
            walked.close()
    except OSError as exc:
        raise from_os_error(exc, path) from None


def remove(req: dict[str, Any]) -> dict[str, Any]:
    path = arg_path(req)
    recursive = arg_bool(req, "recursive")
    if os.path.normpath(path) == "/":
        raise invalid("refusing to remove /")
    try:
        walked = pathwalk.walk(path, follow_last=False)
        try:
            if walked.obj < 0:
                raise FileNotFoundError(errno.ENOENT, "no such file or directory", path)
            st = os.fstat(walked.obj)
            name, parent = walked.name, walked.parent
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=parent)
            elif recursive:
                import shutil  # here: at module level it loads bz2 and lzma into every agent

                shutil.rmtree(name, dir_fd=parent)
            else:
                os.rmdir(name, dir_fd=parent)
        finally:
            walked.close()
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            raise invalid(f"{path}: directory not empty (pass recursive)") from None
        raise from_os_error(exc, path) from None
    return {}
