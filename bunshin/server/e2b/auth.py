"""The per-sandbox envd access token: derived from the server's token and the sandbox id, so
any route can check it without shared state, and one sandbox's token opens no other."""

from __future__ import annotations

import hashlib
import hmac

_LABEL = b"bunshin-e2b-envd\0"


def envd_access_token(server_token: str, sandbox_id: str) -> str:
    """The ``envdAccessToken`` of ``sandbox_id`` (hex HMAC-SHA256 under the server token)."""
    return hmac.new(server_token.encode(), _LABEL + sandbox_id.encode(), hashlib.sha256).hexdigest()


def envd_token_ok(server_token: str, sandbox_id: str, presented: str | None) -> bool:
    """Whether ``presented`` is ``sandbox_id``'s access token (compared in constant time)."""
    if not presented:
        return False
    return hmac.compare_digest(envd_access_token(server_token, sandbox_id), presented)
