"""Pull an image from a registry (v2) through skopeo, then load it into the store.

``skopeo copy docker://REF dir:STAGING`` writes the manifest as the registry served it
and the blobs by digest into a staging folder of the store; ``store.add`` then
checks every digest again while unpacking (and the pinned ``@sha256:`` digest of the
manifest), and the folder is removed whatever happens. HTTPS is verified, except
for a registry on loopback, which may also speak plain HTTP (``--src-tls-verify=false``
is given for nothing else). Credentials: the docker config file
(``$REGISTRY_AUTH_FILE``, ``$DOCKER_CONFIG/config.json``, ``~/.docker/config.json``) or
``BUNSHIN_REGISTRY_USERNAME``/``BUNSHIN_REGISTRY_PASSWORD`` (written to a 0600 auth
file for skopeo, never on its command line).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ...config import Config
from ...errors import HostUnsupported, ImageNotFound, InvalidArgument, RuntimeFailure, Unreachable
from ..state.store import Store
from . import caps
from . import store as oci_store
from .records import ImageRecord
from .refs import Reference
from .sources import DirSource, images_in

SKOPEO = "skopeo"
PULL_TIMEOUT_S = 3600.0
_WATCH_S = 0.2
_UNREACHABLE = ("connection refused", "no such host", "i/o timeout", "network is unreachable",
                "connection reset", "tls: ", "server gave http response", "dial tcp")
_NOT_FOUND = ("manifest unknown", "name unknown", "not found", "unauthorized", "denied",
              "authentication required")


def auth_file(env: dict[str, str] | None = None) -> Path | None:
    """The docker config file to read credentials from, if there is one."""
    env = dict(os.environ) if env is None else env
    for cand in (env.get("REGISTRY_AUTH_FILE"),
                 str(Path(env["DOCKER_CONFIG"]) / "config.json") if env.get("DOCKER_CONFIG") else None,
                 str(Path(env.get("HOME", "/root")) / ".docker" / "config.json")):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


def skopeo_argv(ref: Reference, dest: Path, authfile: Path | None) -> list[str]:
    """The ``skopeo copy`` of ``ref`` into the ``dir:`` folder ``dest``."""
    argv = [SKOPEO, "--insecure-policy", "copy", "--retry-times", "2"]
    if ref.is_loopback:
        argv.append("--src-tls-verify=false")
    if authfile is not None:
        argv += ["--src-authfile", str(authfile)]
    return [*argv, f"docker://{ref}", f"dir:{dest}"]


def pull(cfg: Config, store: Store, text: str, *, progress: oci_store.Progress = oci_store.quiet) -> ImageRecord:
    """Pull ``text`` (``[REGISTRY/]NAME[:TAG][@sha256:...]``) into the store; its record."""
    ref = Reference.parse(text).normalized()
    if shutil.which(SKOPEO) is None:
        raise HostUnsupported("skopeo is not installed", hint="run `make install` (Debian's skopeo pulls images)")
    cfg.paths.image_staging.mkdir(parents=True, exist_ok=True)
    os.chmod(cfg.paths.images, 0o700)
    tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=cfg.paths.image_staging))
    try:
        authfile = _credentials(ref, tmp) or auth_file()
        remote = _remote_manifest(ref, authfile)
        if remote is not None:
            _check_caps(cfg, ref, remote[1])
            stored = _already_stored(cfg, store, ref, *remote)
            if stored is not None:
                progress(f"{ref}: image {stored.short_id} and all its layers already stored")
                return stored
        dest = tmp / "image"
        _run(skopeo_argv(ref, dest, authfile), ref, progress, (dest, caps.max_bytes(cfg)))
        manifest = (dest / "manifest.json").read_bytes()
        served = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if ref.digest and served != ref.digest and "manifests" not in json.loads(manifest):
            # skopeo checks a pinned digest itself; an index's instance has its own digest,
            # so only the list it came from could match (then skopeo matched it)
            _check_index_pin(ref, served, authfile)
        src = DirSource(dest)
        (parts,) = images_in(src, str(ref))
        tag = (ref.name_tag(),) if ref.tag else ()
        return oci_store.add(cfg, store, src, parts, names=tag, digest=ref.digest or served, progress=progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _inspect_raw(ref: str, loopback: bool, authfile: Path | None) -> bytes | None:
    argv = [SKOPEO, "--insecure-policy", "inspect", "--raw", "--retry-times", "2",
            *(["--tls-verify=false"] if loopback else []),
            *(["--authfile", str(authfile)] if authfile is not None else []), f"docker://{ref}"]
    try:
        out = subprocess.run(argv, capture_output=True, timeout=300, check=False)
    except subprocess.TimeoutExpired:
        return None
    return out.stdout if out.returncode == 0 else None


def _remote_manifest(ref: Reference, authfile: Path | None) -> tuple[str, dict[str, Any]] | None:
    """The digest the registry serves for ``ref`` and the manifest of this machine's
    instance (``skopeo inspect --raw``, its digest checked against a pin), no blob; None
    when anything is missing or unclear (the full pull then decides)."""
    raw = _inspect_raw(str(ref), ref.is_loopback, authfile)
    if raw is None:
        return None
    served = "sha256:" + hashlib.sha256(raw).hexdigest()
    if ref.digest and served != ref.digest:
        return None
    try:
        doc = json.loads(raw)
        if isinstance(doc, dict) and "manifests" in doc:  # an index: this machine's instance
            picked = [m for m in doc["manifests"] if (m.get("platform") or {}).get("architecture") == _arch()
                      and (m.get("platform") or {}).get("os", "linux") == "linux"]
            if not picked:
                return None
            raw = _inspect_raw(f"{ref.repository}@{picked[0]['digest']}", ref.is_loopback, authfile)
            if raw is None or "sha256:" + hashlib.sha256(raw).hexdigest() != picked[0]["digest"]:
                return None
            doc = json.loads(raw)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return (served, doc) if isinstance(doc, dict) else None


def _check_caps(cfg: Config, ref: Reference, doc: dict[str, Any]) -> None:
    """Refuse, before a blob is fetched, a manifest of more layers than the cap or whose
    blobs alone (compressed) are larger than the size cap."""
    layers = doc.get("layers")
    if not isinstance(layers, list):
        return
    caps.check_layers(cfg, len(layers), str(ref))
    sizes = [d.get("size") for d in layers if isinstance(d, dict)]
    caps.Budget.of(cfg).check(sum(n for n in sizes if type(n) is int and n > 0), f"{ref}'s layer blobs")


def _already_stored(cfg: Config, store: Store, ref: Reference, served: str, doc: dict[str, Any]) -> ImageRecord | None:
    """The stored image the manifest ``doc`` names, if the store holds it whole."""
    try:
        image_id = doc["config"]["digest"]
    except (KeyError, TypeError):
        return None
    rec = oci_store.complete(cfg, store, image_id) if isinstance(image_id, str) else None
    if rec is None:
        return None
    return oci_store.name(store, rec, (ref.name_tag(),) if ref.tag else (), ref.digest or served)


def _arch() -> str:
    import platform  # noqa: PLC0415

    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)


def _check_index_pin(ref: Reference, served: str, authfile: Path | None) -> None:
    """A pinned digest that is not the manifest's: it must be an index's, the index must
    hash to the pin, and the manifest pulled (digest ``served``) must be one it lists."""
    raw = _inspect_raw(str(ref), ref.is_loopback, authfile)
    try:
        listed = [m["digest"] for m in json.loads(raw)["manifests"]] if raw is not None else []
    except (ValueError, KeyError, TypeError):
        listed = []
    if raw is None or "sha256:" + hashlib.sha256(raw).hexdigest() != ref.digest or served not in listed:
        raise InvalidArgument(f"the registry's manifest for {ref} does not have the pinned digest",
                              hint="the image was replaced, or the digest is wrong: check it")


def _credentials(ref: Reference, tmp: Path) -> Path | None:
    user, password = os.environ.get("BUNSHIN_REGISTRY_USERNAME"), os.environ.get("BUNSHIN_REGISTRY_PASSWORD")
    if not user or password is None:
        return None
    path = tmp / "auth.json"
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {ref.registry: {"auth": token}}}, f)
    return path


def _run(argv: list[str], ref: Reference, progress: oci_store.Progress, watch: tuple[Path, int]) -> None:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "XDG_RUNTIME_DIR", "HTTPS_PROXY",
                                                          "HTTP_PROXY", "NO_PROXY", "https_proxy", "http_proxy",
                                                          "no_proxy")}
    with tempfile.TemporaryFile(mode="w+") as errf:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        # a registry's blob may be longer than its manifest says (skopeo checks its digest at the end)
        with caps.Watch(proc, *watch, _WATCH_S) as watched:
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if line.strip():
                        progress(line.strip())
                proc.wait(timeout=PULL_TIMEOUT_S)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        errf.seek(0)
        err = errf.read()
    if watched.over is not None:
        raise caps.Budget(watch[1]).refuse(f"{ref}'s download ({watched.over} bytes so far, more than its manifest "
                                           "says)")
    if proc.returncode == 0:
        return
    text = err.strip().splitlines()[-1] if err.strip() else f"skopeo exited {proc.returncode}"
    low = err.lower()
    if any(s in low for s in _UNREACHABLE):
        raise Unreachable(f"cannot reach the registry of {ref}: {text}",
                          hint="check the registry's address and that it is up; a registry on another host "
                               "must speak HTTPS")
    if any(s in low for s in _NOT_FOUND):
        raise ImageNotFound(f"the registry has no image {ref} (or refuses it): {text}",
                            hint="check the name and tag; for a private image log in "
                                 "(docker config file, or BUNSHIN_REGISTRY_USERNAME/PASSWORD)")
    raise RuntimeFailure(f"skopeo could not pull {ref}: {text}", hint="see skopeo's message")
