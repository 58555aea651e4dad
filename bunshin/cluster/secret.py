"""The cluster secret: one file the operator provisions to every host, the root of what
a cluster trusts.

Nothing secret crosses Ray (its object store, actor arguments and state, its key-value
store): the head and each host derive what they need from their own copy of the secret
(HKDF-SHA256, RFC 5869, one block per label):

- each host's server token, per host and fencing epoch (a fence rotates it);
- the snapshot key every host's home holds (a root saved on one host loads on another);
- the fencing key that signs the epochs in Ray's key-value store
  (:mod:`bunshin.cluster.fence`) and the endpoints the host actors report.

Anyone who reaches Ray but has no copy of the secret gets no token or key from it, and a
record they write there (an epoch that would empty a host) fails its MAC and is ignored.
The file is 32 random bytes or more, mode 0600 (a file others may read is refused), made
by ``bunshin cluster init`` and copied to the same path on every host.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..errors import InvalidArgument, NotFound

#: The environment variable that names the secret's file (else :func:`default_path`).
ENV = "BUNSHIN_CLUSTER_SECRET"
SIZE = 32
_SALT = b"bunshin-cluster-v1"


def default_path() -> Path:
    """``$BUNSHIN_CLUSTER_SECRET``, else ``BUNSHIN_HOME/cluster.secret``."""
    env = os.environ.get(ENV)
    return Path(env) if env else Config.from_env().home / "cluster.secret"


def _hkdf(secret: bytes, label: str) -> bytes:
    """HKDF-SHA256 (extract, then one block of expand) of ``secret`` for ``label``."""
    prk = hmac.new(_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, label.encode() + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True)
class ClusterSecret:
    """A loaded cluster secret and what derives from it (its bytes stay out of reprs)."""

    path: Path
    _bytes: bytes = field(repr=False)

    @classmethod
    def create(cls, path: Path | None = None) -> ClusterSecret:
        """A new secret at ``path`` (mode 0600, never over an existing file or a symlink)."""
        path = Path(path or default_path())
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise InvalidArgument(f"{path} exists: a cluster keeps the secret it was made with",
                                  hint="copy that file to every host, or remove it first to make a new one (every "
                                       "host then needs the new copy)") from None
        data = os.urandom(SIZE)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return cls(path, data)

    @classmethod
    def load(cls, path: Path | None = None) -> ClusterSecret:
        """The secret at ``path``: a regular file of the owner's only (no symlink), 32+ bytes."""
        path = Path(path or default_path())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"no cluster secret at {path}",
                           hint="make one with `bunshin cluster init` and copy it to the same path on every host "
                                f"(--secret-file or ${ENV} names another)") from None
        except OSError as e:
            raise InvalidArgument(f"cluster secret {path}: {e.strerror} (a symlink is refused)",
                                  hint=f"put the file itself at {path}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise InvalidArgument(f"cluster secret {path} is readable by others (mode {st.st_mode & 0o777:o})",
                                      hint=f"chmod 600 {path}")
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        if len(data) < SIZE:
            raise InvalidArgument(f"cluster secret {path} holds {len(data)} bytes, under {SIZE}",
                                  hint="make a new one with `bunshin cluster init` (on every host)")
        return cls(path, data)

    def derive(self, label: str) -> bytes:
        return _hkdf(self._bytes, label)

    def host_token(self, host: str, epoch: int) -> str:
        """The API token of host ``host``'s server while it serves ``epoch``."""
        return self.derive(f"token/{host}/{epoch}").hex()

    def snapshot_key(self) -> bytes:
        """The snapshot key of every host's home."""
        return self.derive("snapshot-key")

    def fence_key(self) -> bytes:
        """The key that signs fencing records and host endpoints."""
        return self.derive("fence")

    def sign(self, *parts: object) -> str:
        """The MAC (hex) of ``parts`` with :meth:`fence_key`."""
        return hmac.new(self.fence_key(), "\x00".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()

    def verify(self, mac: str, *parts: object) -> bool:
        return hmac.compare_digest(mac.encode(), self.sign(*parts).encode())
