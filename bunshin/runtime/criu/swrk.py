"""CRIU's RPC protocol (``criu swrk FD``): a dump asked for over a socket, its notifications
answered by the caller itself.

An action script is a process CRIU forks and execs at each stage; the ``post-dump`` one
runs while the tasks are frozen, so its start is part of the pause (~1 ms for a static
binary, more for a shell). Over RPC with ``notify_scripts`` CRIU instead sends each
stage's name on its socket and waits for the answer: the caller's handler runs in its
own process, and nothing starts inside the pause.

``request`` turns the command-line options bunshin gives a dump (``criu.dump``'s
``extra``) into the request's fields, refusing any it does not know; ``converse`` sends
it, answers every notification (a handler that raises answers failure: CRIU then
unfreezes the tasks and fails the dump) and returns CRIU's final answer.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bunshin.errors import HostUnsupported, InvalidArgument

MAX_MSG = 1 << 20
#: flags without a value -> the ``criu_opts`` field they set
_FLAGS = {"--file-locks": "file_locks", "--tcp-established": "tcp_established", "--link-remap": "link_remap",
          "--leave-running": "leave_running", "--tcp-close": "tcp_close", "--ext-unix-sk": "ext_unix_sk",
          "--shell-job": "shell_job", "--skip-in-flight": "tcp_skip_in_flight", "--unprivileged": "unprivileged"}
_LOCKS = {"iptables": "IPTABLES", "nftables": "NFTABLES", "skip": "SKIP"}
_CGROUPS = {"ignore": "IGNORE", "none": "CG_NONE", "props": "PROPS", "soft": "SOFT", "full": "FULL",
            "strict": "STRICT"}


def rpc() -> Any:
    """pycriu's generated ``rpc_pb2`` (``python3-pycriu``, which ``make install`` puts in the venv's path)."""
    try:
        import pycriu.rpc_pb2 as rpc_pb2  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise HostUnsupported("pycriu is not importable", hint="install python3-pycriu with protobuf<6 "
                              "(make install does)") from exc
    return rpc_pb2


def _unknown(flag: str) -> InvalidArgument:
    return InvalidArgument(f"criu option {flag!r} has no RPC field here",
                           hint="add it to bunshin/runtime/criu/swrk.py, or dump without notify handlers")


def request(images_dir_fd: int, pid: int, log_file: str, flags: Sequence[str], *, log_level: int = 4) -> Any:
    """A dump request: the tree of ``pid`` into the images folder open as ``images_dir_fd``
    (a descriptor of the caller's: CRIU opens it through /proc), ``flags`` as on the command line."""
    r = rpc()
    req = r.criu_req(type=r.DUMP)
    o = req.opts
    o.images_dir_fd, o.pid, o.log_level, o.log_file, o.notify_scripts = images_dir_fd, pid, log_level, log_file, True
    _set_flags(r, o, flags)
    return req


def restore_request(images_dir: str, log_file: str, flags: Sequence[str], *, root: str | None,
                    log_level: int = 4) -> Any:
    """A restore request (always detached): the images at the path ``images_dir`` (as criu
    sees it), its log ``log_file`` in that folder, ``root``, ``flags`` as on the command line."""
    r = rpc()
    req = r.criu_req(type=r.RESTORE)
    o = req.opts
    o.images_dir_fd, o.images_dir, o.log_level, o.log_file = -1, images_dir, log_level, log_file
    if root is not None:
        o.root = root
    _set_flags(r, o, flags)
    return req


def _set_flags(r: Any, o: Any, flags: Sequence[str]) -> None:
    it = iter(flags)
    for flag in it:
        name, eq, value = flag.partition("=")
        if name in _FLAGS and not eq:
            setattr(o, _FLAGS[name], True)
            continue
        if name == "--manage-cgroups":
            mode = _CGROUPS.get(value) if eq else "SOFT"
            if mode is None:
                raise _unknown(flag)
            o.manage_cgroups, o.manage_cgroups_mode = True, getattr(r, mode)
            continue
        if name not in ("--network-lock", "--ghost-limit", "--external"):
            raise _unknown(flag)
        if not eq:
            following = next(it, None)
            if following is None:
                raise InvalidArgument(f"criu option {flag} needs a value", hint="give it one")
            value = following
        if name == "--network-lock":
            if value not in _LOCKS:
                raise _unknown(f"{name} {value}")
            o.network_lock = getattr(r, _LOCKS[value])
        elif name == "--ghost-limit":
            if not value.isdigit() or int(value) > 0xFFFFFFFF:  # CRIU keeps it in 32 bits
                raise InvalidArgument(f"ghost limit {value} is not a byte count below 4 GiB",
                                      hint="set BUNSHIN_GHOST_LIMIT (Config.ghost_limit) below 4G")
            o.ghost_limit = int(value)
        else:
            o.external.append(value)


@dataclass(frozen=True)
class Answer:
    """CRIU's final answer, and the first notification handler's failure if one failed."""

    success: bool
    errno: int
    errmsg: str
    handler_error: BaseException | None = None


@dataclass(frozen=True)
class Restored:
    """CRIU's answer to a restore: whether it succeeded, the restored root task's pid."""

    success: bool
    pid: int
    errmsg: str


def restore(sock: socket.socket, req: Any) -> Restored:
    """Send a restore request and read CRIU's answer (it sends no notifications)."""
    r = rpc()
    sock.send(req.SerializeToString())
    data = sock.recv(MAX_MSG)
    if not data:
        return Restored(False, -1, "criu closed its socket without an answer")
    resp = r.criu_resp()
    resp.ParseFromString(data)
    return Restored(bool(resp.success), int(resp.restore.pid) if resp.HasField("restore") else -1,
                    str(resp.cr_errmsg))


def converse(sock: socket.socket, req: Any, handlers: Mapping[str, Callable[[], None]]) -> Answer:
    """Send ``req`` and answer CRIU's notifications (``handlers`` by stage name; others
    succeed at once) until its final answer. A handler that raises is answered with
    failure (CRIU then ends the dump); its exception comes back in the answer."""
    r = rpc()
    sock.send(req.SerializeToString())
    failed: BaseException | None = None
    while True:
        data = sock.recv(MAX_MSG)
        if not data:
            return Answer(False, 0, "criu closed its socket without an answer", failed)
        resp = r.criu_resp()
        resp.ParseFromString(data)
        if resp.type != r.NOTIFY:
            return Answer(bool(resp.success), int(resp.cr_errno), str(resp.cr_errmsg), failed)
        ok = True
        handler = handlers.get(resp.notify.script)
        if handler is not None and failed is None:
            try:
                handler()
            except BaseException as exc:  # noqa: BLE001 (answered as failure, raised by the caller)
                failed, ok = exc, False
        sock.send(r.criu_req(type=r.NOTIFY, notify_success=ok).SerializeToString())
