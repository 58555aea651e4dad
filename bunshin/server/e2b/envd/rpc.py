"""Connect RPC plumbing of envd: services built from the generated descriptors, the call's
sandbox, and bunshin's errors in Connect's shape.

Each service is a ``connectrpc`` ASGI application (the Connect protocol over HTTP/1.1,
unary and server-streaming, JSON and binary protobuf codecs through ``google.protobuf``).
Every method of the service's descriptor has an endpoint: the ones bunshin implements
call their handler; the others answer ``unimplemented`` naming the method and the envd
version served. The handlers learn their call's sandbox from :data:`CALL` (set by the
envd app after the access token was checked, before the service runs).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from connectrpc.code import Code
from connectrpc.compat import google_protobuf_codecs
from connectrpc.errors import ConnectError
from connectrpc.method import IdempotencyLevel, MethodInfo
from connectrpc.request import RequestContext
from connectrpc.server import ConnectASGIApplication, Endpoint
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from ....errors import BunshinError
from ....workspace import Workspace
from ...context import ServerContext
from . import ENVD_VERSION

#: A user name as ``useradd`` takes it.
USER_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
#: Largest request message a call takes (a ``SendInput`` chunk, a path).
READ_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Call:
    """The sandbox an envd call is for, the user it names (``None``: the default), and
    whether its client hung up (``gone``: set when the server reads ``http.disconnect``)."""

    ctx: ServerContext
    ws: Workspace
    user: str | None
    gone: asyncio.Event = field(default_factory=asyncio.Event)


CALL: ContextVar[Call] = ContextVar("bunshin_e2b_envd_call")


#: Streams of one kind one sandbox may hold open at once: each polls its sandbox through
#: the agent in a thread of the server's shared pool, under the sandbox's lock.
MAX_STREAMS = 32


class Live:
    """How many streams of one kind are being served now, in all and by sandbox (a stream
    whose client hung up is not: the tests hold the server to it); a sandbox holds at
    most ``MAX_STREAMS`` of a kind."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._by_sandbox: dict[str, int] = {}  # the event loop's thread only

    @contextmanager
    def held(self, sandbox_id: str) -> Iterator[None]:
        """One more stream of ``sandbox_id``; ``resource_exhausted`` past ``MAX_STREAMS``."""
        n = self._by_sandbox.get(sandbox_id, 0)
        if n >= MAX_STREAMS:
            raise ConnectError(Code.RESOURCE_EXHAUSTED, f"the sandbox has {MAX_STREAMS} {self.what} open: "
                                                        "end some before opening another")
        self._by_sandbox[sandbox_id] = n + 1
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1
            if self._by_sandbox[sandbox_id] <= 1:
                del self._by_sandbox[sandbox_id]
            else:
                self._by_sandbox[sandbox_id] -= 1


#: Commands being followed (Start, Connect) and folders being watched (WatchDir).
FOLLOWING, WATCHING = Live("commands followed"), Live("folders watched")

Unary = Callable[[Any, Call, RequestContext], Awaitable[Message]]
Stream = Callable[[Any, Call, RequestContext], AsyncIterator[Message]]
ClientStream = Callable[[AsyncIterator[Any], Call, RequestContext], Awaitable[Message]]


def user_of(authorization: str | None) -> str | None:
    """The user an ``Authorization: Basic base64(user:)`` header names (how the SDK picks a
    command's or a file's user); ``None`` without one. A malformed one is refused."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value.strip(), validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.INVALID_ARGUMENT, "the Authorization header is not base64 of 'user:'") from None
    if not user:
        return None
    if USER_NAME.fullmatch(user) is None:
        raise ConnectError(Code.INVALID_ARGUMENT, f"{user[:40]!r} is not a user name")
    return user


_CODES = {
    "invalid_argument": Code.INVALID_ARGUMENT, "payload_too_large": Code.RESOURCE_EXHAUSTED,
    "not_found": Code.NOT_FOUND, "path_not_found": Code.NOT_FOUND, "workspace_not_found": Code.UNAVAILABLE,
    "unauthorized": Code.UNAUTHENTICATED, "state_conflict": Code.FAILED_PRECONDITION,
    "timeout": Code.DEADLINE_EXCEEDED, "resource_exhausted": Code.RESOURCE_EXHAUSTED,
    "rate_limited": Code.RESOURCE_EXHAUSTED, "unreachable": Code.UNAVAILABLE,
}


def connect_error(e: BunshinError) -> ConnectError:
    """A bunshin error as the Connect error the SDK maps to its own exception."""
    message = e.message if not e.hint else f"{e.message} ({e.hint})"
    if e.code == "workspace_not_found":
        message = f"The sandbox was not found: {e.message}"
    return ConnectError(_CODES.get(e.code, Code.INTERNAL), message)


def _unimplemented(full_name: str) -> Callable[[Any, RequestContext], Awaitable[Message]]:
    async def refuse(_req: Any, _ctx: RequestContext) -> Message:
        raise ConnectError(Code.UNIMPLEMENTED,
                           f"{full_name} is not implemented by bunshin's envd (it serves envd {ENVD_VERSION})")
    return refuse


def _unary(fn: Unary) -> Callable[[Any, RequestContext], Awaitable[Message]]:
    async def call(req: Any, ctx: RequestContext) -> Message:
        try:
            return await fn(req, CALL.get(), ctx)
        except BunshinError as e:
            raise connect_error(e) from None
    return call


def _stream(fn: Stream) -> Callable[[Any, RequestContext], AsyncIterator[Message]]:
    async def call(req: Any, ctx: RequestContext) -> AsyncIterator[Message]:
        try:
            async for message in fn(req, CALL.get(), ctx):
                yield message
        except BunshinError as e:
            raise connect_error(e) from None
    return call


def _client_stream(fn: ClientStream) -> Callable[[AsyncIterator[Any], RequestContext], Awaitable[Message]]:
    async def call(reqs: AsyncIterator[Any], ctx: RequestContext) -> Message:
        try:
            return await fn(reqs, CALL.get(), ctx)
        except BunshinError as e:
            raise connect_error(e) from None
    return call


def service_app(service: ServiceDescriptor, unary: Mapping[str, Unary], streams: Mapping[str, Stream],
                clients: Mapping[str, ClientStream] | None = None) -> ConnectASGIApplication[None]:
    """The Connect app of ``service``: ``unary``, server-``streams`` and client-stream
    (``clients``) handlers by method name; every other method refused by name."""
    clients = clients or {}
    endpoints: dict[str, Any] = {}
    for m in service.methods:
        info = MethodInfo(name=m.name, service_name=service.full_name, input=GetMessageClass(m.input_type),
                          output=GetMessageClass(m.output_type), idempotency_level=IdempotencyLevel.UNKNOWN)
        path = f"/{service.full_name}/{m.name}"
        if m.name in streams:
            endpoints[path] = Endpoint.server_stream(info, _stream(streams[m.name]))
        elif m.name in clients:
            endpoints[path] = Endpoint.client_stream(info, _client_stream(clients[m.name]))
        elif m.name in unary:
            endpoints[path] = Endpoint.unary(info, _unary(unary[m.name]))
        else:
            refuse = _unimplemented(f"{service.full_name}/{m.name}")
            if m.server_streaming and not m.client_streaming:
                endpoints[path] = Endpoint.server_stream(info, _refuse_stream(refuse))
            elif m.client_streaming:
                endpoints[path] = Endpoint.client_stream(info, _refuse_client_stream(refuse))
            else:
                endpoints[path] = Endpoint.unary(info, refuse)

    class App(ConnectASGIApplication[None]):
        @property
        def path(self) -> str:
            return f"/{service.full_name}"

    return App(service=None, endpoints=lambda _: endpoints, codecs=google_protobuf_codecs(),
               read_max_bytes=READ_MAX_BYTES)


def _refuse_stream(refuse: Callable[[Any, RequestContext], Awaitable[Message]]) -> Callable[..., AsyncIterator[Message]]:
    async def call(req: Any, ctx: RequestContext) -> AsyncIterator[Message]:
        yield await refuse(req, ctx)
    return call


def _refuse_client_stream(refuse: Callable[[Any, RequestContext], Awaitable[Message]]) -> Callable[..., Awaitable[Message]]:
    async def call(reqs: AsyncIterator[Any], ctx: RequestContext) -> Message:
        return await refuse(None, ctx)
    return call
