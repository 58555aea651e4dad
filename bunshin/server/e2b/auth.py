"""The per-sandbox tokens: derived from the server's token and the sandbox id, so any route
can check them without shared state, and one sandbox's token opens no other.

``envdAccessToken`` (header ``X-Access-Token``) opens envd; ``trafficAccessToken`` (header
``E2B-Traffic-Access-Token``) opens the sandbox's ports (the code interpreter's context
routes send only it). Both are in the create and connect answers. A file URL the SDK signs
(``download_url``/``upload_url``: ``file_signature``) opens envd's ``/files`` for its one
path, operation and user, until its expiration if it has one."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

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


#: The file URL operations a signature names: ``read`` (``GET /files``), ``write`` (``POST``).
FILE_OPERATIONS = {"GET": "read", "POST": "write"}


def file_signature(server_token: str, sandbox_id: str, path: str, operation: str, user: str,
                   expiration: int | None) -> str:
    """E2B's v1 file URL signature, as the SDK makes it (``get_signature``): ``v1_`` and the
    unpadded base64 of the SHA-256 of ``path:operation:user:envdAccessToken[:expiration]``."""
    token = envd_access_token(server_token, sandbox_id)
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode("ascii")


def file_url_refusal(server_token: str, sandbox_id: str, method: str, query: dict[str, str]) -> str | None:
    """Why a signed file URL (``?signature=``, ``&signature_expiration=``, ``&path=``,
    ``&username=``) does not open ``method /files`` of ``sandbox_id``; None when it does."""
    operation = FILE_OPERATIONS.get(method)
    if operation is None:
        return f"a signed file URL is for GET or POST, not {method}"
    expiration: int | None = None
    if (text := query.get("signature_expiration")) is not None:
        if not text.isdigit() or len(text) > 12:
            return "signature_expiration is not a Unix time in seconds"
        expiration = int(text)
        if expiration < time.time():
            return "the file URL's signature has expired: ask the SDK for a new URL"
    expected = file_signature(server_token, sandbox_id, query.get("path", ""), operation,
                              query.get("username", ""), expiration)
    if not _matches(expected, query.get("signature")):
        return (f"the file URL's signature is not this sandbox's for {operation} of this path and user: "
                "make it with the SDK's download_url / upload_url")
    return None
