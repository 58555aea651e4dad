"""The code interpreter's contexts, kept inside the sandbox's workspace.

A context is a folder ``/run/bunshin-e2b/contexts/<id>/`` holding ``context.json``
(``{"id", "language", "cwd"}``) and, once it ran code, the socket and pid of its Python
interpreter (``bunshin/agent/pyrepl.py`` run by the image's ``python3``, as the ``python``
tool runs it). Both are workspace state: a fork's clones have every context, each
continuing its interpreter's globals on its own, and a server restart loses none.

Every operation is one exec (a short ``sh`` script): creating checks the folder and writes
the record, a run checks the context (the default one is made on first use) and execs
``pyrepl.py call``, restart and remove kill the interpreter by its pid file after checking
that the pid is still that context's interpreter.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass

from ....errors import InvalidArgument, NotFound, RuntimeFailure
from ....tools.python_tool import REPL
from ....workspace.protocol import WorkspaceAPI

CONTEXTS_DIR = "/run/bunshin-e2b/contexts"
#: The context ``run_code`` uses when given neither a context nor another language.
DEFAULT_ID = "default-python"
#: Its working folder (E2B's), or ``/`` where the image has no such folder.
DEFAULT_CWD = "/home/user"
LANGUAGES = ("python",)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
MISSING = 3  # the scripts' exit status for "no such context" (and "no such folder")
_SH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Context:
    """One interpreter context, as E2B's API shows it."""

    id: str
    language: str
    cwd: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def language_of(name: str | None) -> str:
    """The context language ``name`` asks for (``None``: python); others refused by name."""
    lang = (name or "python").strip().lower()
    if lang not in LANGUAGES:
        raise InvalidArgument(f"language {name!r} is not supported by bunshin's code interpreter",
                              hint="it runs python only: leave language unset or pass 'python'")
    return lang


def check_id(context_id: str) -> str:
    if not _ID.fullmatch(context_id):
        raise NotFound(f"context {context_id!r} not found", hint="list the contexts: GET /contexts")
    return context_id


def folder(context_id: str) -> str:
    return f"{CONTEXTS_DIR}/{check_id(context_id)}"


def _sh(ws: WorkspaceAPI, script: str, *args: str) -> tuple[int, str]:
    r = ws.exec(["/bin/sh", "-c", script, "sh", *args], timeout=_SH_TIMEOUT_S)
    if r.exit_code not in (0, MISSING):
        raise RuntimeFailure(f"the code interpreter's context script failed ({r.exit_code}): "
                             f"{(r.stderr or r.stdout).strip()[-500:]}", hint="is /bin/sh in the sandbox's image?")
    return r.exit_code or 0, r.stdout


# $1 the folder wanted, $2 the context's folder, $3 its id, $4 1: fall back to / if $1 is not there
_CREATE = ('cwd="$1"; test -d "$cwd" || { test "$4" = 1 || exit 3; cwd=/; }; mkdir -p "$2" && '
           'printf "%s" "$cwd" > "$2/cwd" && '
           'printf \'{"id": "%s", "language": "python", "cwd": "%s"}\\n\' "$3" "$cwd" > "$2/context.json" && '
           'printf "%s" "$cwd"')
_PATH = re.compile(r"/[^\x00-\x1f\"\\]{0,4095}")


def create(ws: WorkspaceAPI, language: str | None, cwd: str | None) -> Context:
    """A new context (a fresh interpreter, started by its first run) working in ``cwd``
    (default: /home/user, or / where the image has none)."""
    language_of(language)
    if cwd is not None and not _PATH.fullmatch(cwd):
        raise InvalidArgument(f"cwd {cwd!r} is not an absolute path (without quotes, backslashes or "
                              "control characters)", hint="e.g. cwd='/home/user'")
    cid = uuid.uuid4().hex
    status, made = _sh(ws, _CREATE, cwd or DEFAULT_CWD, folder(cid), cid, "0" if cwd else "1")
    if status == MISSING:
        raise InvalidArgument(f"cwd {cwd!r} is not a folder in the sandbox", hint="make it first (files.make_dir)")
    return Context(cid, "python", made)


_LIST = f'for f in {CONTEXTS_DIR}/*/context.json; do test -f "$f" && cat "$f"; done; exit 0'


def listing(ws: WorkspaceAPI) -> list[Context]:
    _, out = _sh(ws, _LIST)
    found = []
    for line in out.splitlines():
        try:
            d = json.loads(line)
            found.append(Context(str(d["id"]), str(d["language"]), str(d["cwd"])))
        except (ValueError, KeyError, TypeError):
            continue  # a record the workspace garbled: not a context
    return sorted(found, key=lambda c: c.id)


# The pid file names the interpreter only while /proc says that pid runs pyrepl serve in this folder.
_KILL = ('test -f "$1/context.json" || exit 3; pid=$(cat "$1/py.pid" 2>/dev/null) || pid=; '
         'case "$pid" in ""|*[!0-9]*) ;; *) tr "\\0" " " < "/proc/$pid/cmdline" 2>/dev/null '
         '| grep -qF "pyrepl.py serve $1" && kill -"$2" "$pid";; esac; ')
_RESTART = _KILL + 'rm -f "$1/py.sock" "$1/py.pid"'
_REMOVE = _KILL + 'rm -rf "$1"'
_INTERRUPT = _KILL + "exit 0"


def restart(ws: WorkspaceAPI, context_id: str) -> None:
    """Kill the context's interpreter: its next run starts a fresh one in the same folder."""
    if _sh(ws, _RESTART, folder(context_id), "KILL")[0] == MISSING:
        raise NotFound(f"context {context_id!r} not found", hint="list the contexts: GET /contexts")


def remove(ws: WorkspaceAPI, context_id: str) -> None:
    if _sh(ws, _REMOVE, folder(context_id), "KILL")[0] == MISSING:
        raise NotFound(f"context {context_id!r} not found", hint="list the contexts: GET /contexts")


def interrupt(ws: WorkspaceAPI, context_id: str) -> None:
    """SIGINT to the context's interpreter (``KeyboardInterrupt`` in the code it runs)."""
    _sh(ws, _INTERRUPT, folder(context_id), "INT")


#: Where a run's request, answer and the call's own errors wait (``<run id>.req`` / ``.reply`` / ``.log``).
RUNS_DIR = "/run/bunshin-e2b/runs"

# $1 the context's folder, $2 1 if it is the default one (made on first use; any other must
# exist), $3 the default's folder, $4 pyrepl.py, $5 the run's files without their suffix.
# The call reads the request and writes the answer; whatever it ends with, .reply appears
# whole (renamed into place): the answer, or {"exit_status": N} (3: no such context,
# 127: no python3; then .log has the call's stderr). ``-S``: the call needs no site packages
# and starts in about half the time (the interpreter it starts has them).
_RUN = ('d="$1"; r="$5"; '
        'ended() { printf \'{"exit_status": %d}\\n\' "$1" > "$r.tmp"; rm -f "$r.req"; mv "$r.tmp" "$r.reply"; exit 0; }; '
        'if ! test -f "$d/context.json"; then test "$2" = 1 || ended 3; '
        'cwd="$3"; test -d "$cwd" || cwd=/; mkdir -p "$d" && printf "%s" "$cwd" > "$d/cwd" && '
        'printf \'{"id": "%s", "language": "python", "cwd": "%s"}\\n\' "${d##*/}" "$cwd" > "$d/context.json"; fi; '
        'python3 -S "$4" call "$d" "$(cat "$d/cwd" 2>/dev/null || echo /)" < "$r.req" > "$r.tmp" 2> "$r.log"; '
        'st=$?; test "$st" = 0 || ended "$st"; rm -f "$r.req"; mv "$r.tmp" "$r.reply"')


def run_argv(context_id: str, run_base: str) -> list[str]:
    """The background command that runs one request (``run_base.req``) in the context's
    interpreter and leaves its answer in ``run_base.reply`` (see ``_RUN``)."""
    default = "1" if context_id == DEFAULT_ID else "0"
    return ["/bin/sh", "-c", _RUN, "sh", folder(context_id), default, DEFAULT_CWD, REPL, run_base]
