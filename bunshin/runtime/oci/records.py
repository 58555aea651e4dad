"""The records of the image store: an image's run config and the stored image."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidArgument

KIND = "image"  # the store's object kind of image records
LAYER_KIND = "image-layer"  # and of layer records (size, files)
LAYER_TAR_KIND = "image-layer-tar"  # a layer's exported tar: its sha256 and size (``layer_tar``)


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"the image config's {what} is not a list of strings",
                              hint="the image is malformed: rebuild it")
    return tuple(value)


@dataclass(frozen=True)
class ImageConfig:
    """What ``docker run`` takes from an image's config: ``Env``, ``WorkingDir``, ``User``,
    ``Entrypoint`` and ``Cmd``."""

    env: tuple[str, ...] = ()
    working_dir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: dict[str, Any]) -> ImageConfig:
        """From an OCI/Docker image config document (its ``config`` member)."""
        c = config.get("config") or {}
        if not isinstance(c, dict):
            raise InvalidArgument("the image config's 'config' is not an object", hint="rebuild the image")
        for key in ("WorkingDir", "User"):
            if not isinstance(c.get(key) or "", str):
                raise InvalidArgument(f"the image config's {key} is not a string", hint="rebuild the image")
        env = _strings(c.get("Env"), "Env")
        if any("=" not in e or e.startswith("=") or "\0" in e for e in env):
            raise InvalidArgument("the image config's Env holds an entry that is not NAME=VALUE",
                                  hint="rebuild the image")
        return cls(env=env, working_dir=c.get("WorkingDir") or "", user=c.get("User") or "",
                   entrypoint=_strings(c.get("Entrypoint"), "Entrypoint"), cmd=_strings(c.get("Cmd"), "Cmd"))

    def command(self, args: tuple[str, ...] | list[str] | None) -> list[str]:
        """``docker run IMAGE [ARGS]``'s command: the entrypoint followed by ``args``, or by
        ``Cmd`` without them."""
        return [*self.entrypoint, *(args if args else self.cmd)]

    def env_dict(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.env)

    def agent_defaults(self) -> dict[str, Any]:
        """What the workspace's agent applies to every command it starts (``BUNSHIN_IMAGE``)."""
        return {"env": self.env_dict(), "cwd": self.working_dir or "/", "user": self.user}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageConfig:
        return cls(env=tuple(d["env"]), working_dir=d["working_dir"], user=d["user"],
                   entrypoint=tuple(d["entrypoint"]), cmd=tuple(d["cmd"]))


@dataclass(frozen=True)
class ImageRecord:
    """A stored image. ``id``: the digest of its config (as docker names images);
    ``layers``: diff ids, base first; ``digests``: manifest digests it was pulled or loaded
    by; ``names``: references that name it (``docker.io/library/x:tag``)."""

    id: str
    layers: tuple[str, ...]
    config: ImageConfig
    size_bytes: int
    created_at: float
    names: tuple[str, ...] = ()
    digests: tuple[str, ...] = ()
    architecture: str = ""
    os: str = ""
    raw_config: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def short_id(self) -> str:
        return self.id.removeprefix("sha256:")[:12]

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> ImageRecord:
        d = json.loads(text)
        return cls(id=d["id"], layers=tuple(d["layers"]), config=ImageConfig.from_dict(d["config"]),
                   size_bytes=d["size_bytes"], created_at=d["created_at"], names=tuple(d["names"]),
                   digests=tuple(d["digests"]), architecture=d.get("architecture", ""), os=d.get("os", ""),
                   raw_config=d.get("raw_config", {}))

    def summary(self) -> dict[str, Any]:
        """The record as ``image ls --json`` shows it."""
        return {"id": self.id, "names": list(self.names), "digests": list(self.digests),
                "layers": len(self.layers), "size_bytes": self.size_bytes, "created_at": self.created_at}

    def inspect(self) -> dict[str, Any]:
        """Everything, as ``image inspect --json`` shows it."""
        return {**self.summary(), "layers": list(self.layers), "config": self.config.to_dict(),
                "architecture": self.architecture, "os": self.os}
