"""The agent layer: a read-only overlay layer that brings the in-workspace agent.

It holds a stripped-down copy of the host's Python (binary, shared libraries
including the dynamic loader, and just the standard-library modules the agent
imports) plus the agent's own source, under ``/.bunshin``. The agent therefore
runs in any image, even one without Python or a C library, and never uses the
image's libraries. The layer is built once per agent version on tmpfs (overlayfs
refuses layers that share a filesystem with the host root used as a lower layer).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..agent.jobs import CALLS
from ..errors import InvalidArgument, RuntimeFailure

AGENT_SRC = Path(__file__).resolve().parent.parent / "agent"
BUNDLE_FORMAT = "3"
# Modules the agent may import lazily; imported up-front while computing the closure.
EXTRA_MODULES = (
    "pty", "tty", "termios", "select", "selectors", "subprocess", "ctypes", "json", "base64",
    "signal", "threading", "socket", "struct", "fcntl", "secrets", "shutil", "argparse",
    "traceback", "dataclasses", "typing", "errno", "stat", "encodings.idna", "encodings.latin_1",
    "encodings.ascii", "encodings.utf_8", "codecs", "io", "time", "queue", "uuid", "glob", "fnmatch",
)

_CLOSURE_SCRIPT = r"""
import importlib, json, os, sys, pkgutil
import bunshin_agent
for m in pkgutil.iter_modules(bunshin_agent.__path__):
    importlib.import_module("bunshin_agent." + m.name)
for name in sys.argv[1].split(","):
    importlib.import_module(name)  # the standard library's: a missing one fails the build, not the agent
files = sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})
libs = set()
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and ".so" in parts[5]:
        libs.add(parts[5])
print(json.dumps({"files": files, "libs": sorted(libs)}))
"""


#: How agents started from now on serve calls (``bunshin_agent --calls``): ``thread`` (the
#: default: no fork on a call's path) or ``fork`` (a worker per connection: a forked
#: clone keeps ~0.7 MiB instead of ~2.9 MiB after its first exec and tool call).
CALLS_ENV = "BUNSHIN_AGENT_CALLS"


def agent_calls() -> str:
    """The ``--calls`` of new agents, from ``$BUNSHIN_AGENT_CALLS`` (``thread`` if unset)."""
    calls = os.environ.get(CALLS_ENV) or "thread"
    if calls not in CALLS:
        raise InvalidArgument(f"{CALLS_ENV}={calls!r} is not one of {', '.join(CALLS)}",
                              hint=f"set {CALLS_ENV} to thread or fork, or unset it")
    return calls


@dataclass(frozen=True)
class AgentBundle:
    """A built agent layer and how to start the agent inside a workspace."""

    layer: Path

    SOCKET = "/.bunshin/run/agent.sock"
    LOG = "/.bunshin/run/agent.log"
    RUN_DIR = "/run/bunshin"  # the agent's default --run-dir: identity.json, fork-id
    #: Where ``bunshin/agent/*.py`` lands inside every workspace; the tools run some of
    #: its stdlib-only modules by path under the image's own python3 (pyrepl, fndriver).
    PACKAGE_DIR = "/.bunshin/agent/bunshin_agent"

    @property
    def argv(self) -> list[str]:
        return [
            "/.bunshin/lib/ld-linux-x86-64.so.2",
            "--library-path",
            "/.bunshin/lib",
            "/.bunshin/python/bin/python3",
            "-s",
            "-B",
            "-m",
            "bunshin_agent",
            "--socket",
            self.SOCKET,
            "--calls",
            agent_calls(),
        ]

    @property
    def env(self) -> dict[str, str]:
        return {
            "PYTHONHOME": "/.bunshin/python",
            "PYTHONPATH": "/.bunshin/agent",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
        }

    @classmethod
    def ensure(cls, layers_dir: Path) -> AgentBundle:
        """Build the layer for the current agent source unless it exists already."""
        layer = layers_dir / current_layer_name()
        if not layer.is_dir():
            layers_dir.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".agent-", dir=layers_dir))
            try:
                _build(tmp)
                os.rename(tmp, layer)
            except FileExistsError:
                pass  # built concurrently by another process
            except OSError as e:
                if not layer.is_dir():
                    raise RuntimeFailure(f"cannot build the agent layer in {layers_dir}: {e}") from e
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return cls(layer)


def current_layer_name() -> str:
    """The folder name of the agent layer for the agent source installed now."""
    return f"agent-{_source_hash()}"


def _source_hash() -> str:
    h = hashlib.sha256(BUNDLE_FORMAT.encode() + sys.version.encode() + sys.base_prefix.encode())
    for f in sorted(AGENT_SRC.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _python_binary() -> Path:
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    path = Path(sys.base_prefix) / "bin" / name
    if not path.exists():
        raise RuntimeFailure(f"cannot find the host Python binary at {path}")
    return path


def _build(out: Path) -> None:
    root = out / ".bunshin"
    agent_pkg = root / "agent" / "bunshin_agent"
    agent_pkg.mkdir(parents=True)
    for f in AGENT_SRC.glob("*.py"):
        shutil.copy2(f, agent_pkg / f.name)
    (root / "run").mkdir()
    (root / "empty").mkdir()  # bound read-only over masked /proc and /sys folders
    python = _python_binary()
    proc = subprocess.run(
        [str(python), "-S", "-c", _CLOSURE_SCRIPT, ",".join(EXTRA_MODULES)],
        env={"PYTHONPATH": str(root / "agent"), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeFailure(f"cannot compute the agent's module closure: {proc.stderr.strip()}")
    closure = json.loads(proc.stdout)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    dest_stdlib = root / "python" / "lib" / stdlib.name
    for f in map(Path, closure["files"]):
        f = f.resolve()
        if f.is_relative_to(stdlib):
            rel = f.relative_to(stdlib)
            _copy(f, dest_stdlib / rel)
    # os.py is the landmark Python uses to accept PYTHONHOME.
    _copy(stdlib / "os.py", dest_stdlib / "os.py")
    (dest_stdlib / "lib-dynload").mkdir(exist_ok=True)
    lib = root / "lib"
    lib.mkdir()
    for so in map(Path, closure["libs"]):
        if so.resolve().is_relative_to(stdlib):
            continue  # extension modules were copied with the stdlib
        _copy(so, lib / so.name, strip=True)
        for alias in _aliases(so):  # sonames are symlinks next to the real file
            if not (lib / alias).exists():
                (lib / alias).symlink_to(so.name)
    ld = lib / "ld-linux-x86-64.so.2"
    if not ld.exists():
        raise RuntimeFailure("the dynamic loader ld-linux-x86-64.so.2 was not found in the closure")
    bindir = root / "python" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy2(python, bindir / "python3")
    import compileall

    compileall.compile_dir(str(root / "agent"), quiet=1)
    compileall.compile_dir(str(dest_stdlib), quiet=1)
    for p in [out, *out.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)


def _aliases(so: Path) -> list[str]:
    real = so.resolve()
    try:
        return [p.name for p in so.parent.iterdir() if p.is_symlink() and p.resolve() == real and p.name != so.name]
    except OSError:
        return []


def _copy(src: Path, dst: Path, *, strip: bool = False) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)
    if strip and shutil.which("strip"):
        subprocess.run(["strip", "--strip-unneeded", str(dst)], capture_output=True, check=False)
