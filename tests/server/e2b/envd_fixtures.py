"""A real ``bunshin serve`` on loopback and one workspace, reached by the unmodified ``e2b``
SDK in ``sandbox_url`` mode (the SDK's public constructor, as ``Sandbox.connect`` builds it),
shared by a test module."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from packaging.version import Version

from bunshin.config import Config
from bunshin.server.e2b.auth import envd_access_token
from bunshin.server.e2b.envd import ENVD_VERSION
from bunshin.server.thread import serve_in_thread
from bunshin.workspace import Workspace

TOKEN = "test-token-e2b-envd-0123456789"


@dataclass
class Env:
    url: str
    ws: Workspace

    @property
    def access_token(self) -> str:
        return envd_access_token(TOKEN, self.ws.id)

    def sandbox(self, cls: type, *, sandbox_id: str | None = None, token: str | None = None):  # noqa: ANN201
        """The SDK's sandbox object for ``sandbox_id`` (this workspace) with ``token`` (its own)."""
        from e2b import ConnectionConfig

        sid = sandbox_id or self.ws.id
        at = self.access_token if token is None else token
        cc = ConnectionConfig(api_key="e2b_unused", api_url=self.url, sandbox_url=self.url, request_timeout=30,
                              extra_sandbox_headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983",
                                                     "X-Access-Token": at})
        return cls(sandbox_id=sid, sandbox_domain=None, envd_version=Version(ENVD_VERSION),
                   envd_access_token=at, connection_config=cc)


def drop_everything(url: str, token: str = TOKEN, verify: ssl.SSLContext | bool = True) -> None:
    """Remove every sandbox and template (a snapshot the first create from an image keeps)
    through E2B's API."""
    with httpx.Client(base_url=url, headers={"X-API-Key": token}, timeout=60, verify=verify) as c:
        for sb in c.get("/v2/sandboxes").json():
            c.delete(f"/sandboxes/{sb['sandboxID']}")
        for t in c.get("/templates").json():
            assert c.delete(f"/templates/{t['templateID']}").status_code == 204


@contextmanager
def served(cfg: Config) -> Iterator[Env]:
    ws = Workspace.create("host", config=cfg, memory="1G")
    try:
        with serve_in_thread(cfg, TOKEN) as url:
            try:
                yield Env(url, ws)
            finally:
                ws.remove()
                drop_everything(url)
    finally:
        if ws.is_alive():
            ws.remove()
