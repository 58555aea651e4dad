"""One sandbox cannot take the server's threads: through the unmodified ``e2b`` SDK over
loopback, sandbox A jams its share of the pool (``send_stdin`` to a command that never reads
it blocks in the workspace, holding A's lock, until its 30 s timeout; every other call of A
waits behind it), and meanwhile sandbox B's commands, ``Sandbox.list`` and a create answer
at once, A's calls past its waiting room get E2B's 429 (``RateLimitException``) at once, and
none of A's calls hangs once A is gone. The server runs a small pool (16 threads, 4 a
sandbox) so the share is reached with few calls."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import pytest

pytest.importorskip("e2b")

from e2b import RateLimitException, Sandbox, SandboxException  # noqa: E402

from bunshin.server.shares import MAX_WAITING  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import TOKEN, drop_everything  # noqa: E402

pytestmark = pytest.mark.integration

SHARE = 4
#: A's calls: its share, its waiting room, and 8 more that are refused.
CALLS = SHARE + MAX_WAITING + 8
#: How long B and the control plane may take while A is jammed (each answers in well under 1 s alone).
BOUND_S = 10.0


def test_a_jammed_sandbox_leaves_the_others_and_the_control_plane_answering(cfg) -> None:  # noqa: ANN001
    with serve_in_thread(cfg, TOKEN, threads=16, sandbox_threads=SHARE) as url:
        opts = {"api_url": url, "sandbox_url": url, "api_key": TOKEN}
        pool = ThreadPoolExecutor(CALLS)
        try:
            a, b = Sandbox.create(timeout=120, **opts), Sandbox.create(timeout=120, **opts)
            quiet = a.commands.run("sleep 600", background=True, stdin=True)  # never reads its stdin
            t0 = time.monotonic()
            jam = [pool.submit(a.commands.send_stdin, quiet.pid, "x" * (512 << 10), request_timeout=120)
                   for _ in range(CALLS)]
            refused = _until(lambda: [f for f in jam if f.done() and isinstance(f.exception(), RateLimitException)],
                             CALLS - SHARE - MAX_WAITING)
            assert time.monotonic() - t0 < BOUND_S  # refused at once, not after a wait
            assert "calls running" in str(refused[0].exception())

            t1 = time.monotonic()
            assert b.commands.run("echo b").stdout == "b\n"  # B: its own share
            b.files.write("/tmp/b", "b")
            assert b.files.read("/tmp/b") == "b"
            assert {a.sandbox_id, b.sandbox_id} <= {s.sandbox_id for s in Sandbox.list(**opts).next_items()}
            Sandbox.create(timeout=120, **opts).kill()  # the control plane: its own half of the pool
            assert time.monotonic() - t1 < BOUND_S, time.monotonic() - t1
            # the rest of A's calls: jammed all along. A call takes A's share at each step (the
            # sandbox, the process, its stdin), so one let in at the first may still be refused at
            # a later one when the share has filled meanwhile: more than the 8 may be refused, and
            # nothing of A's is answered otherwise
            assert all(isinstance(f.exception(), RateLimitException) for f in jam if f.done())

            a.kill()  # the call holding A's lock ends with it, and every one waiting behind it
            done, pending = wait(jam, timeout=60)
            assert not pending
            assert all(isinstance(f.exception(), SandboxException) for f in done)
            b.kill()
        finally:
            with contextlib.suppress(Exception):  # A's calls end with A (also when the test failed)
                drop_everything(url)
            pool.shutdown(wait=True, cancel_futures=True)
    assert leftovers(cfg) == {}


def _until(found: Callable[[], list[Future[None]]], n: int) -> list[Future[None]]:
    """``found()`` once it has ``n`` futures (within ``BOUND_S``)."""
    deadline = time.monotonic() + BOUND_S
    while len(got := found()) < n:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)
    return got
