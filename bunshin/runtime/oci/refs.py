"""Image references: ``[REGISTRY/]NAME[:TAG][@sha256:HEX]``, normalised as docker does
(``busybox`` is ``docker.io/library/busybox:latest``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import InvalidArgument

DEFAULT_REGISTRY = "docker.io"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?$")
HINT = "give NAME[:TAG][@sha256:HEX], e.g. docker.io/library/python:3.12 or localhost:5000/team/env:v1"


@dataclass(frozen=True)
class Reference:
    """A parsed reference; ``registry`` is None for a name given without one."""

    registry: str | None
    name: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str) -> Reference:
        if not isinstance(text, str) or not text or len(text) > 512 or any(c.isspace() for c in text):
            raise InvalidArgument(f"{text!r} is not an image reference", hint=HINT)
        rest, _, digest = text.partition("@")
        if digest and not _DIGEST.match(digest):
            raise InvalidArgument(f"{text!r}: the digest {digest!r} is not sha256:<64 hex digits>", hint=HINT)
        registry = None
        first, slash, remainder = rest.partition("/")
        if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            if not _HOST.match(first):
                raise InvalidArgument(f"{text!r}: {first!r} is not a registry host[:port]", hint=HINT)
            registry, rest = first, remainder
        name, tag = rest, None
        if ":" in rest.rsplit("/", 1)[-1]:
            name, _, tag = rest.rpartition(":")
            if not _TAG.match(tag):
                raise InvalidArgument(f"{text!r}: the tag {tag!r} is not valid", hint=HINT)
        if not _NAME.match(name):
            raise InvalidArgument(f"{text!r}: the name {name!r} is not a valid repository name", hint=HINT)
        return cls(registry, name, tag, digest or None)

    @property
    def has_registry(self) -> bool:
        """Does the text name its registry (so a pull knows where to go)?"""
        return self.registry is not None

    def normalized(self) -> Reference:
        """With docker's defaults: registry docker.io, ``library/`` for one-part names
        there, tag ``latest`` unless a digest pins it."""
        registry = self.registry or DEFAULT_REGISTRY
        name = f"library/{self.name}" if registry == DEFAULT_REGISTRY and "/" not in self.name else self.name
        tag = self.tag if self.tag or self.digest else "latest"
        return Reference(registry, name, tag, self.digest)

    @property
    def repository(self) -> str:
        return f"{self.registry}/{self.name}" if self.registry else self.name

    @property
    def is_loopback(self) -> bool:
        host = (self.registry or "").rsplit(":", 1)[0] if not (self.registry or "").startswith("[") \
            else (self.registry or "").split("]")[0] + "]"
        return host in ("localhost", "[::1]") or host.startswith("127.")

    def __str__(self) -> str:
        return self.repository + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def name_tag(self) -> str:
        """The name to record (``repository:tag``), without the digest."""
        return self.repository + (f":{self.tag}" if self.tag else "")


def looks_like_ref(text: str) -> bool:
    """Could ``text`` be a reference (rather than a folder path)?"""
    try:
        Reference.parse(text)
    except InvalidArgument:
        return False
    return True
