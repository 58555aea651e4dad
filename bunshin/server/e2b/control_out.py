"""E2B's answers built from bunshin's records: a created sandbox, its detail, a listed one,
its metrics, and the pages of a list (``X-Next-Token``)."""

from __future__ import annotations

import base64
import binascii
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import psutil
from fastapi import Request

from ...api.models import MAX_TTL_S
from ...errors import NotFound
from ...workspace import Workspace
from ..context import ServerContext
from .auth import envd_access_token, traffic_access_token
from .sandboxes import Sandbox, SandboxRecord, resources
from .shapes import CLIENT_ID, ENVD_VERSION, E2BError, iso


def domain(ctx: ServerContext, request: Request) -> str:
    """The sandbox domain: the server's (``--e2b-domain``), else ``localhost:<port called>``."""
    if ctx.e2b_domain:
        return ctx.e2b_domain
    port = request.url.port
    return f"localhost:{port}" if port else "localhost"


def created(ctx: ServerContext, request: Request, rec: SandboxRecord) -> dict[str, Any]:
    """E2B's ``Sandbox``: what create, connect, resume and fork answer."""
    return {"templateID": rec.template_id, "sandboxID": rec.id, "clientID": CLIENT_ID,
            "envdVersion": ENVD_VERSION, "envdAccessToken": envd_access_token(ctx.token, rec.id),
            "trafficAccessToken": traffic_access_token(ctx.token, rec.id), "domain": domain(ctx, request)}


def listed(ctx: ServerContext, sb: Sandbox) -> dict[str, Any]:
    """E2B's ``ListedSandbox``."""
    rec, info = sb.record, sb.info
    lease = ctx.leases.get(rec.id) if info is not None else None
    if lease is not None:
        end = lease.expires_at
    elif info is not None:  # no lease: it lives until killed; E2B wants a time, the longest lease's end
        end = rec.started_at + MAX_TTL_S
    else:  # paused: it stays until killed or resumed
        end = (rec.paused_at or rec.started_at) + MAX_TTL_S
    memory = info.memory_limit if info is not None else _snapshot_memory(ctx, rec)
    return {"templateID": rec.template_id, "sandboxID": rec.id, "clientID": CLIENT_ID,
            "startedAt": iso(rec.started_at), "endAt": iso(end), "envdVersion": ENVD_VERSION,
            "state": sb.state, "metadata": rec.metadata, **resources(memory)}


def detail(ctx: ServerContext, request: Request, sb: Sandbox) -> dict[str, Any]:
    """E2B's ``SandboxDetail``."""
    return {**listed(ctx, sb), "envdAccessToken": envd_access_token(ctx.token, sb.id),
            "allowInternetAccess": sb.record.allow_internet_access, "domain": domain(ctx, request)}


def _snapshot_memory(ctx: ServerContext, rec: SandboxRecord) -> int | None:
    from ...workspace import Snapshot

    try:
        return Snapshot.get(rec.snapshot or "", config=ctx.config).record.memory_limit
    except NotFound:
        return None


class Metrics:
    """Samples of the sandboxes' CPU, memory and disk; CPU use is over the time since the
    last sample of the same sandbox (the first: since it started)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, float]] = {}  # id -> (when, cpu seconds)

    def sample(self, ctx: ServerContext, sandbox_id: str) -> dict[str, Any]:
        ws = Workspace.get(sandbox_id, config=ctx.config)
        st, now, cpus = ws.stats(), time.time(), os.cpu_count() or 1
        with self._lock:
            since, cpu_before = self._last.get(sandbox_id, (ws.record.created_at, 0.0))
            self._last[sandbox_id] = (now, st.cpu_s)
        pct = 100.0 * max(0.0, st.cpu_s - cpu_before) / max(now - since, 1e-3) / cpus
        limit = ws.record.memory_limit or psutil.virtual_memory().total
        try:
            fs = os.statvfs(ws.record.upper)
            disk_total, disk_used = fs.f_blocks * fs.f_frsize, (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        except OSError:
            disk_total = disk_used = 0
        mem = st.memory
        return {"timestamp": iso(now), "timestampUnix": int(now), "cpuCount": cpus,
                "cpuUsedPct": round(min(pct, 100.0), 2), "memUsed": mem.cgroup_bytes, "memTotal": limit,
                "memCache": max(0, mem.cgroup_bytes - mem.anon_bytes), "diskUsed": disk_used,
                "diskTotal": disk_total}

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._last.pop(sandbox_id, None)


# --- pages --------------------------------------------------------------------------

def page(items: Sequence[tuple[tuple[float, str], Any]], next_token: str | None, limit: int, *,
         descending: bool) -> tuple[list[Any], str | None]:
    """One page of ``items`` (sorted by their keys ``(started, id)``, ``descending`` or not):
    those after the cursor ``next_token``, at most ``limit``, and the cursor of the next page
    (None: this is the last). A cursor holds a key, so items made or gone meanwhile neither
    repeat nor shift the pages."""
    start = 0
    if next_token:
        cursor = _cursor(next_token)
        start = next((i for i, (k, _) in enumerate(items) if (k < cursor if descending else k > cursor)),
                     len(items))
    chunk = list(items[start:start + limit])
    more = start + limit < len(items)
    token = _token(chunk[-1][0]) if more and chunk else None
    return [v for _, v in chunk], token


def _token(key: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(f"{key[0]!r} {key[1]}".encode()).decode().rstrip("=")


def _cursor(token: str) -> tuple[float, str]:
    try:
        if len(token) > 128:
            raise ValueError
        when, _, sid = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode().partition(" ")
        return float(when), sid
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise E2BError(400, f"nextToken {token[:40]!r} is not one this server gave") from None
