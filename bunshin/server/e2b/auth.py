"""The per-sandbox tokens: derived from the server's token and the sandbox id, so any route
can check them without shared state, and one sandbox's token opens no other.

``envdAccessToken`` (header ``X-Access-Token``) opens envd; ``trafficAccessToken`` (header
``E2B-Traffic-Access-Token``) opens the sandbox's ports (the code interpreter's context
routes send only it). Both are in the create and connect answers."""

from __future__ import annotations

import hashlib
import hmac

_LABEL = b"bunshin-e2b-envd\0"
_TRAFFIC_LABEL = b"bunshin-e2b-traffic\0"


def _derive(server_token: str, label: bytes, sandbox_id: str) -> str:
    return hmac.new(server_token.encode(), label + sandbox_id.encode(), hashlib.sha256).hexdigest()


def _matches(expected: str, presented: str | None) -> bool:
    return bool(presented) and hmac.compare_digest(expected, presented or "")


def envd_access_token(server_token: str, sandbox_id: str) -> str:
    """The ``envdAccessToken`` of ``sandbox_id`` (hex HMAC-SHA256 under the server token)."""
    return _derive(server_token, _LABEL, sandbox_id)


def envd_token_ok(server_token: str, sandbox_id: str, presented: str | None) -> bool:
    """Whether ``presented`` is ``sandbox_id``'s access token (compared in constant time)."""
    return _matches(envd_access_token(server_token, sandbox_id), presented)


def traffic_access_token(server_token: str, sandbox_id: str) -> str:
    """The ``trafficAccessToken`` of ``sandbox_id`` (another HMAC label than envd's token)."""
    return _derive(server_token, _TRAFFIC_LABEL, sandbox_id)


def traffic_token_ok(server_token: str, sandbox_id: str, presented: str | None) -> bool:
    """Whether ``presented`` is ``sandbox_id``'s traffic token (compared in constant time)."""
    return _matches(traffic_access_token(server_token, sandbox_id), presented)
