"""Starting a program with ``_posixsubprocess.fork_exec`` itself, without ``subprocess.Popen``.

``Popen`` runs a few hundred lines of Python per child (handles, pipes wrapped in io
objects, the exec-error protocol), and in a forked clone each object that code touches
is a page the clone copies from the snapshot. This does the same steps with the C
function ``Popen`` calls (file descriptors closed but the three given, signals restored,
a new session, ``preexec_fn`` run between fork and exec) and reads the child's error
pipe the same way: a failed exec raises the ``OSError`` ``Popen`` would.
"""

from __future__ import annotations

import _posixsubprocess
import builtins
import os
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL


class Stream:
    """The agent's end of a child's pipe: a descriptor (what ``Popen``'s io object was used for)."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _child_end(spec: Any, *, reading: bool, opened: list[int]) -> tuple[int, int]:
    """(the child's descriptor, the agent's end of a pipe or -1) for ``spec``: ``PIPE``,
    ``DEVNULL``, a descriptor, or ``None`` (inherited)."""
    if spec is None:
        return -1, -1
    if spec == PIPE:
        r, w = os.pipe()
        opened.extend((r, w))
        return (r, w) if reading else (w, r)
    if spec == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        opened.append(fd)
        return fd, -1
    if isinstance(spec, int) and spec >= 0:
        return spec, -1
    raise ValueError(f"invalid stream {spec!r}")


def start(argv: Sequence[str], *, env: dict[str, str], cwd: str, stdin: Any, stdout: Any, stderr: Any,
          preexec_fn: Callable[[], None] | None) -> tuple[int, Stream | None, Stream | None, Stream | None]:
    """Fork and exec ``argv`` in a new session; (pid, stdin, stdout, stderr), a ``Stream`` for
    each ``PIPE``. ``OSError`` as ``Popen`` raises it if the program cannot be run (its
    ``filename`` the program, or ``cwd`` when changing to it failed); ``SubprocessError``
    if ``preexec_fn`` raised."""
    args = [os.fsencode(a) for a in argv]
    env_list = []
    for k, v in env.items():
        key = os.fsencode(k)
        if b"=" in key:
            raise ValueError("illegal environment variable name")
        env_list.append(key + b"=" + os.fsencode(v))
    program = args[0]
    if b"/" in program:
        executables: tuple[bytes, ...] = (program,)
    else:
        # PATH as os.get_exec_path reads it (without its warnings.catch_warnings: more code run)
        executables = tuple(os.fsencode(d or ".") + b"/" + program
                            for d in env.get("PATH", os.defpath).split(os.pathsep))
    opened: list[int] = []
    kept: list[int] = []  # the agent's ends, kept on success
    try:
        p2cread, p2cwrite = _child_end(stdin, reading=True, opened=opened)
        c2pwrite, c2pread = _child_end(stdout, reading=False, opened=opened)
        errwrite, errread = _child_end(stderr, reading=False, opened=opened)
        kept = [fd for fd in (p2cwrite, c2pread, errread) if fd >= 0]
        errpipe_read, errpipe_write = os.pipe()
        try:
            try:
                pid = _posixsubprocess.fork_exec(
                    args, executables, True, (errpipe_write,), cwd, env_list,
                    p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                    errpipe_read, errpipe_write, True, True, -1, None, None, None, -1,
                    preexec_fn, True)  # type: ignore[arg-type]  # None: no preexec_fn
            finally:
                os.close(errpipe_write)
            data = bytearray()
            while True:
                part = os.read(errpipe_read, 50000)
                data += part
                if not part or len(data) > 50000:
                    break
        finally:
            os.close(errpipe_read)
        if data:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            raise _exec_error(bytes(data), argv[0], cwd)
    except BaseException:
        for fd in opened:
            try:
                os.close(fd)
            except OSError:
                pass
        raise
    for fd in opened:
        if fd not in kept:
            os.close(fd)  # the child's ends (and /dev/null): the child has its own copies

    def stream(fd: int) -> Stream | None:
        return Stream(fd) if fd >= 0 else None

    return pid, stream(p2cwrite), stream(c2pread), stream(errread)


def _exec_error(data: bytes, program: str, cwd: str) -> Exception:
    """The exception the child reported on its error pipe (``name:hex errno:message``)."""
    try:
        name, hex_errno, raw = data.split(b":", 2)
        message = raw.decode()
    except ValueError:
        return subprocess.SubprocessError(f"bad exception data from child: {data!r}")
    kind = getattr(builtins, name.decode("ascii", "replace"), subprocess.SubprocessError)
    if isinstance(kind, type) and issubclass(kind, OSError) and hex_errno:
        number = int(hex_errno, 16)
        filename = cwd if message == "noexec" else program  # noexec: chdir(cwd) failed
        return kind(number, os.strerror(number) if number else "", filename)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return subprocess.SubprocessError(message)
