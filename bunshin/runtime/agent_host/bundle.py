"""The agent layer: a read-only overlay layer that brings the in-workspace agent.

It holds a stripped-down copy of a host Python (binary, shared libraries
including the dynamic loader, and just the standard-library modules the agent
imports) plus the agent's own source, under ``/.bunshin``. Which Python
(``agent_python``): ``$BUNSHIN_AGENT_PYTHON``, else a Python 3.12 (then 3.13) that runs,
on ``PATH`` or installed by pyenv, else the one running bunshin. From 3.12 on the agent
makes every object it holds when ready immortal (``agent/immortal.py``), so a forked
clone's calls no longer write (and so copy) the pages of the objects they only use.
The agent therefore runs in any image, even one without Python or a C library, and never uses the
image's libraries. The layer is built once per agent version on tmpfs (overlayfs
refuses layers that share a filesystem with the host root used as a lower layer).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...agent.jobs import CALLS
from ...errors import InvalidArgument, RuntimeFailure

AGENT_SRC = Path(__file__).resolve().parents[2] / "agent"
BUNDLE_FORMAT = "4"
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
files = {m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
for name in list(sys.modules):  # a submodule imported as an alias of another (3.13: collections.abc)
    parent, _, leaf = name.rpartition(".")
    for folder in getattr(sys.modules.get(parent), "__path__", None) or ():
        if os.path.isfile(os.path.join(folder, leaf + ".py")):
            files.add(os.path.join(folder, leaf + ".py"))
files = sorted(files)
libs = set()
for line in open("/proc/self/maps"):
    parts = line.split()
    if len(parts) >= 6 and ".so" in parts[5]:
        libs.add(parts[5])
print(json.dumps({"files": files, "libs": sorted(libs)}))
"""


#: The Python the agent layer is made of (a path or a command on ``PATH``); see the module docstring.
PYTHON_ENV = "BUNSHIN_AGENT_PYTHON"
#: Looked for when ``$BUNSHIN_AGENT_PYTHON`` is unset, in this order (3.12 first: its clones
#: measured smallest, ``bench clone-memory``), on ``PATH`` and then in pyenv's versions.
NEWER_PYTHONS = ("python3.12", "python3.13")
_DESCRIBE = (
    "import json, sys, sysconfig; print(json.dumps({'version': '%d.%d' % sys.version_info[:2], "
    "'full': sys.version, 'base_prefix': sys.base_prefix, 'stdlib': sysconfig.get_paths()['stdlib']}))"
)


@dataclass(frozen=True)
class AgentPython:
    """The interpreter the agent layer is built from."""

    binary: Path  # <base_prefix>/bin/pythonX.Y
    version: str  # "3.12"
    full: str  # its sys.version
    stdlib: Path


def agent_python() -> AgentPython:
    """The interpreter of new agent layers: ``$BUNSHIN_AGENT_PYTHON``, else the first of
    ``NEWER_PYTHONS`` that runs (on ``PATH``, then pyenv's), else the Python running bunshin."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    return _agent_python(os.environ.get(PYTHON_ENV) or "", os.environ.get("PATH", ""), pyenv)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _pyenv_pythons(root: str, name: str) -> list[str]:
    """``name`` (``python3.12``) in each of pyenv's versions that has it, the newest first."""
    try:
        versions = [v for v in os.listdir(os.path.join(root, "versions")) if v[:1].isdigit()]
    except OSError:
        return []
    versions.sort(key=lambda v: [int(p) if p.isdigit() else -1 for p in v.split(".")], reverse=True)
    found = (os.path.join(root, "versions", v, "bin", name) for v in versions)
    return [path for path in found if os.path.isfile(path)]


@functools.lru_cache(maxsize=8)
def _agent_python(explicit: str, path: str, pyenv: str) -> AgentPython:
    if explicit:
        found = _describe(explicit)
        if found is None:
            raise InvalidArgument(f"{PYTHON_ENV}={explicit!r} is not a Python 3.11 or later that runs",
                                  hint=f"point {PYTHON_ENV} at a python3.11+ binary, or unset it")
        return found
    for name in NEWER_PYTHONS:
        on_path = shutil.which(name, path=path)  # a pyenv shim may be there and not run: tried next
        for command in [*([on_path] if on_path else []), *_pyenv_pythons(pyenv, name)]:
            found = _describe(command)
            if found is not None:
                return found
    here = _describe(sys.executable)
    if here is None:
        raise RuntimeFailure(f"cannot describe the Python running bunshin ({sys.executable})")
    return here


def _describe(command: str) -> AgentPython | None:
    """What ``command`` is, if it is a Python 3.11 or later that runs (``None`` otherwise)."""
    try:
        proc = subprocess.run([command, "-S", "-c", _DESCRIBE], capture_output=True, text=True,
                              timeout=30, check=False, env={"PATH": os.environ.get("PATH", "")})
        info = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    if not isinstance(info, dict) or _version(info["version"]) < (3, 11):
        return None
    binary = Path(info["base_prefix"]) / "bin" / f"python{info['version']}"
    if not binary.is_file():
        return None
    return AgentPython(binary, info["version"], info["full"], Path(info["stdlib"]).resolve())


#: How agents started from now on serve calls (``bunshin_agent --calls``): ``thread`` (the
#: default: no fork on a call's path) or ``fork`` (a worker per connection: a forked
#: clone keeps ~0.5 MiB instead of ~0.9 MiB after its first exec and tool call, at 2-10x the latency).
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
    immortal: bool = False  # its Python makes the agent's objects immortal (3.12 and later)

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
            # UTF-8 without a locale: glibc then maps no locale file and no gconv cache of the
            # image (two mappings fewer to dump per fork; children get their own LANG: BASE_ENV)
            "PYTHONUTF8": "1",
            "PYTHONCOERCECLOCALE": "0",
            # 3.12+: the objects it holds are immortal (agent/immortal.py); what a call allocates
            # then goes to glibc's per-thread arenas, not into the free blocks pymalloc left all
            # over the snapshot's pools (a clone's first exec and tool call: ~1.1 -> ~0.85 MiB)
            **({"PYTHONMALLOC": "malloc"} if self.immortal else {}),
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
        return cls(layer, immortal=_version(agent_python().version) >= (3, 12))


def current_layer_name() -> str:
    """The folder name of the agent layer for the agent source installed now."""
    return f"agent-{_source_hash()}"


def _source_hash() -> str:
    python = agent_python()
    h = hashlib.sha256(BUNDLE_FORMAT.encode() + python.full.encode() + str(python.binary).encode())
    for f in sorted(AGENT_SRC.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _build(out: Path) -> None:
    root = out / ".bunshin"
    agent_pkg = root / "agent" / "bunshin_agent"
    agent_pkg.mkdir(parents=True)
    for f in AGENT_SRC.glob("*.py"):
        shutil.copy2(f, agent_pkg / f.name)
    (root / "run").mkdir()
    (root / "empty").mkdir()  # bound read-only over masked /proc and /sys folders
    interpreter = agent_python()
    python = interpreter.binary
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
    stdlib = interpreter.stdlib
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
    for folder in (root / "agent", dest_stdlib):  # by the agent's Python: its own .pyc format
        done = subprocess.run([str(python), "-S", "-m", "compileall", "-q", str(folder)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeFailure(f"cannot compile {folder} with {python}: {done.stdout.strip()} {done.stderr.strip()}")
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
