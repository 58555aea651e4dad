"""The shapes of E2B's control plane (``spec/openapi.yml`` of e2b-dev/E2B): its requests as
pydantic models with E2B's field names, its answers, and its error (``{"code": int,
"message": str}`` with the HTTP status as ``code``), from which the ``e2b`` SDK raises its
own exceptions (404 ``NotFoundException``, 401 ``AuthenticationException``, 429
``RateLimitException``...)."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ...api.models import MAX_COUNT, MAX_TTL_S
from ...errors import BunshinError
from .envd import ENVD_VERSION as ENVD_VERSION  # sandboxes report what envd serves

#: ``clientID`` of every sandbox (E2B's names the node; bunshin serves one host).
CLIENT_ID = "bunshin"
#: Metadata and env vars of one sandbox: entries, and characters of a key or a value.
MAX_METADATA = 64
MAX_METADATA_KEY = 256
MAX_METADATA_VALUE = 1024
MAX_ENVS = 256
MAX_ENV_KEY = 256
MAX_ENV_VALUE = 32 << 10
#: A template id or snapshot name.
MAX_TEMPLATE_ID = 256
#: Sandboxes of one page of a list (E2B's ``limit`` is 1..100).
MAX_PAGE = 100
#: Longest timeout a sandbox takes, in seconds (the server's longest lease).
MAX_TIMEOUT_S = int(MAX_TTL_S)

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class E2BError(Exception):
    """An answer in E2B's error shape: ``status`` is the HTTP status and the body's ``code``."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    @classmethod
    def of(cls, exc: BunshinError) -> E2BError:
        """bunshin's error as E2B's: its status, its message and hint in one line."""
        message = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
        retry = exc.details.get("retry_after")
        return cls(exc.http_status, message, retry_after=retry if isinstance(retry, int | float) else None)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(max(1, math.ceil(self.retry_after)))} if self.retry_after else {}
        return JSONResponse({"code": self.status, "message": self.message}, status_code=self.status,
                            headers=headers)


def _metadata(d: dict[str, str]) -> dict[str, str]:
    if len(d) > MAX_METADATA:
        raise ValueError(f"{len(d)} metadata entries: at most {MAX_METADATA}")
    for k, v in d.items():
        if not 0 < len(k) <= MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
            raise ValueError(f"metadata keys take 1 to {MAX_METADATA_KEY} characters and values at most "
                             f"{MAX_METADATA_VALUE}")
    return d


def _envs(d: dict[str, str]) -> dict[str, str]:
    if len(d) > MAX_ENVS:
        raise ValueError(f"{len(d)} env vars: at most {MAX_ENVS}")
    for k, v in d.items():
        if len(k) > MAX_ENV_KEY or not _ENV_KEY.fullmatch(k) or len(v) > MAX_ENV_VALUE or "\0" in v:
            raise ValueError(f"env var {k[:64]!r}: a name is letters, digits and _ (not first a digit, at most "
                             f"{MAX_ENV_KEY}), a value at most {MAX_ENV_VALUE} characters without NUL")
    return d


Metadata = Annotated[dict[str, str], AfterValidator(_metadata)]
Envs = Annotated[dict[str, str], AfterValidator(_envs)]
Timeout = Annotated[int, Field(ge=1, le=MAX_TIMEOUT_S, description="seconds until the sandbox is killed")]
TemplateId = Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_ID)]


class Request(BaseModel):
    """E2B's request bodies: fields it adds later are ignored, the ones bunshin cannot honour
    are refused by name (:func:`refused`)."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)


class NewSandbox(Request):
    template_id: TemplateId = Field(alias="templateID")
    timeout: Timeout | None = None
    metadata: Metadata | None = None
    env_vars: Envs | None = Field(default=None, alias="envVars")
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    auto_resume: Any = Field(default=None, alias="autoResume")
    mcp: Any = None
    iam: Any = None
    volume_mounts: list[Any] | None = Field(default=None, alias="volumeMounts")


class ConnectSandbox(Request):
    timeout: Timeout | None = None
    memory: bool | None = None


class ResumedSandbox(Request):
    timeout: Timeout | None = None
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    memory: bool | None = None


class TimeoutRequest(Request):
    timeout: Timeout


class RefreshRequest(Request):
    duration: Annotated[int, Field(ge=0, le=3600)] | None = None


class ForkRequest(Request):
    timeout: Timeout | None = None
    count: int = Field(default=1, ge=1, le=MAX_COUNT)


class PauseRequest(Request):
    memory: bool | None = None


class SnapshotRequest(Request):
    name: Annotated[str, Field(min_length=1, max_length=MAX_TEMPLATE_ID, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
                    ] | None = None
    memory: bool | None = None


def refused(req: NewSandbox) -> str | None:
    """What in a create bunshin cannot honour, named; None: all of it can be."""
    net = req.network or {}
    for name in ("allowPublicTraffic", "egressProxy", "rules", "dnsServers", "maskRequestHost", "httpsPorts"):
        if net.get(name):
            return f"network.{name}: not supported by bunshin's E2B API (allowOut and denyOut are)"
    if req.allow_internet_access is False and (net.get("allowOut") or net.get("denyOut")):
        return "network.allowOut/denyOut with allow_internet_access=false: a sandbox without internet has no rules"
    for name, value in (("autoPause", req.auto_pause), ("autoResume", req.auto_resume), ("mcp", req.mcp),
                        ("iam", req.iam), ("volumeMounts", req.volume_mounts)):
        if value:
            return f"{name}: not supported by bunshin's E2B API (leave it out)"
    return None


def egress(req: NewSandbox) -> tuple[list[str], list[str]] | None:
    """The allow and deny rules of a sandbox with internet access (``allow_internet_access``,
    or ``network.allowOut``/``denyOut`` given without it); None: no network (the default:
    a sandbox restores from its template's snapshot, which holds none)."""
    net = req.network or {}
    allow, deny = rules(net.get("allowOut")), rules(net.get("denyOut"))
    if req.allow_internet_access or (req.allow_internet_access is None and (allow or deny)):
        return allow, deny
    return None


def rules(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > 256 or not all(isinstance(v, str) and 0 < len(v) <= 253
                                                                  for v in value):
        raise E2BError(400, "network.allowOut/denyOut: at most 256 CIDRs, addresses or domain names")
    return list(value)


def iso(t: float) -> str:
    """Epoch seconds as E2B's RFC 3339 time."""
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")
