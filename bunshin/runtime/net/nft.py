"""nftables commands run in this process through libnftables (what ``nft`` itself links).

One context per process, used under a lock (a context is not thread-safe); a batch of
commands is one transaction in the kernel: all applied or none. In-process a
workspace's table costs ~1.5 ms to add; ``nft -f`` costs a fork and exec more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from ...errors import HostUnsupported, RuntimeFailure

_LIB_NAMES = ("libnftables.so.1", ctypes.util.find_library("nftables") or "libnftables.so")
NFT_CTX_OUTPUT_JSON = 1 << 4


class _Ctx:
    def __init__(self) -> None:
        lib = None
        for name in _LIB_NAMES:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise HostUnsupported("libnftables is not installed", hint="apt-get install nftables (scripts/install.sh)")
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        for fn in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        for fn in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        self.lib = lib
        self.ctx = lib.nft_ctx_new(0)
        lib.nft_ctx_buffer_output(self.ctx)
        lib.nft_ctx_buffer_error(self.ctx)
        self.lock = threading.Lock()


_ctx: _Ctx | None = None
_ctx_lock = threading.Lock()


def _context() -> _Ctx:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = _Ctx()
        return _ctx


def run(commands: str, *, json_output: bool = False) -> str:
    """Run ``commands`` (nft syntax, one transaction); their output. RuntimeFailure with
    nft's message if the kernel or the parser refuses them (nothing applied then)."""
    c = _context()
    with c.lock:
        return _run(c, commands, json_output)


def run_here(commands: str) -> str:
    """``run`` with a context of its own, made and freed in the calling thread: for a thread
    that joined another network namespace (the process's context talks to the one it was
    made in)."""
    c = _Ctx()
    try:
        return _run(c, commands, False)
    finally:
        c.lib.nft_ctx_free(c.ctx)


def _run(c: _Ctx, commands: str, json_output: bool) -> str:
    c.lib.nft_ctx_output_set_flags(c.ctx, NFT_CTX_OUTPUT_JSON if json_output else 0)
    rc = c.lib.nft_run_cmd_from_buffer(c.ctx, commands.encode())
    out = (c.lib.nft_ctx_get_output_buffer(c.ctx) or b"").decode(errors="replace")
    err = (c.lib.nft_ctx_get_error_buffer(c.ctx) or b"").decode(errors="replace")
    if rc != 0:
        raise RuntimeFailure(f"nftables refused: {err.strip() or 'error ' + str(rc)}",
                             hint="`nft list ruleset` shows the host's tables; see docs/guides/network.md")
    return out


def tables(prefix: str, *, here: bool = False) -> list[str]:
    """The names of the ``inet`` tables whose name starts with ``prefix`` (``here``: in the
    calling thread's network namespace, ``run_here``)."""
    out = (run_here if here else run)("list tables inet")
    names = [line.split()[2] for line in out.splitlines() if line.startswith("table inet ")]
    return [n for n in names if n.startswith(prefix)]
