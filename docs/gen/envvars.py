"""Every ``BUNSHIN_*`` variable in one table. The names are found by scanning the code
(bunshin/, scripts/, tests/, the Makefile); what each means is written once, below. A name
found without a description, or described but no longer found, fails the docs build."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

NAME = re.compile(r"\bBUNSHIN_[A-Z0-9_]*[A-Z0-9]\b")
SCANNED = ("bunshin", "scripts", "tests", "Makefile")
SUFFIXES = {".py", ".sh", ".c", ""}


@dataclass(frozen=True)
class Var:
    """One variable: who sets it (``user``, ``install``, ``test``, ``internal``), its default, what it does."""

    scope: str
    default: str
    meaning: str


VARS: dict[str, Var] = {
    "BUNSHIN_HOME": Var("user", "`/var/lib/bunshin`",
                        "The home: the SQLite store, the image layer store, saved transfers, the server's "
                        "token and snapshot key. Two homes never touch each other (own tmpfs folder and "
                        "cgroup names), not even through `gc`."),
    "BUNSHIN_TMPFS": Var("user", "`/dev/shm/bunshin` (a non-default home gets its own)",
                         "The tmpfs holding workspace uppers, frozen layers, snapshot images and memory "
                         "files; mounted on first use, unmounted by `gc` once nothing is left."),
    "BUNSHIN_DNS_UPSTREAM": Var("user", "the host's /etc/resolv.conf nameservers",
                                "Comma-separated DNS servers the host's resolver asks for the names an egress "
                                "workspace's policy allows (a config's `dns_upstream` wins). The test suite sets "
                                "it to 127.0.0.1, so no test's lookup leaves the machine."),
    "BUNSHIN_CRIU": Var("user", "`/opt/bunshin/criu/bin/criu`", "The CRIU binary (>= 4.2)."),
    "BUNSHIN_GHOST_LIMIT": Var("user", "`256M`",
                               "The largest deleted-but-open file a fork carries (CRIU's `--ghost-limit`); "
                               "bytes or a K/M/G size. Each clone gets a private copy of such a file."),
    "BUNSHIN_FORK_PRECOPY": Var("user", "`1`",
                                "`1`/`0`: convert large processes' memory live before a fork's dump "
                                "(the first fork of a big workspace then pauses it for a delta only)."),
    "BUNSHIN_FORK_PRECOPY_MIN_MIB": Var("user", "`1024`",
                                        "The least anonymous memory (MiB, >= 16) of a process the live "
                                        "pre-copy takes on."),
    "BUNSHIN_FORK_CPU_BOOST": Var("user", "`8`",
                                  "CPU weight factor of a fork's host threads while it runs (`0` or `1`: off)."),
    "BUNSHIN_RESTORE_CPU_BOOST": Var("user", "`8`",
                                     "CPU weight factor of a clone's tasks while CRIU restores them "
                                     "(`0` or `1`: off)."),
    "BUNSHIN_CGROUP_FAVOR_DYNMODS": Var("user", "on",
                                        "`0` leaves the host's cgroup2 mount as it is; otherwise bunshin turns "
                                        "on `favordynmods` before a batch of restores (cheaper cgroup moves; "
                                        "Linux >= 6.0)."),
    "BUNSHIN_AGENT_PYTHON": Var("user", "a Python 3.12 or 3.13 on `PATH`, else the running one",
                                "The host Python the in-workspace agent runs on (copied into the agent layer)."),
    "BUNSHIN_AGENT_CALLS": Var("user", "`thread`",
                               "How new agents serve calls: `thread`, or `fork` (a worker per call: "
                               "~0.5 MiB per clone instead of ~0.9 MiB, 2-10x the latency)."),
    "BUNSHIN_IMAGE_MAX_BYTES": Var("user", "`32G`",
                                   "The most one image load, pull or build may unpack (`--max-size`)."),
    "BUNSHIN_IMAGE_MAX_LAYERS": Var("user", "`125`",
                                    "The most layers one image may have (`--max-layers`)."),
    "BUNSHIN_REGISTRY_USERNAME": Var("user", "unset",
                                     "Registry user for pulls when no docker config file has credentials."),
    "BUNSHIN_REGISTRY_PASSWORD": Var("user", "unset", "The password that goes with it (handed to skopeo in a 0600 file)."),
    "BUNSHIN_URL": Var("user", "`http://127.0.0.1:8770`",
                       "The `bunshin serve` a client, `bunshin rollout --url` or an adapter talks to."),
    "BUNSHIN_TOKEN": Var("user", "unset",
                         "The server's API token for clients (else `token=` or `token_file=`)."),
    "BUNSHIN_CLUSTER_SECRET": Var("user", "`BUNSHIN_HOME/cluster.secret`",
                                  "The cluster secret file, the same on every host of a Ray cluster."),
    "BUNSHIN_BIN_LINK": Var("install", "`/usr/local/bin/bunshin`", "Where `make install` links the command."),
    "BUNSHIN_FORCE_PIP": Var("install", "`0`", "`1`: `make install` re-runs pip even if nothing changed."),
    "BUNSHIN_INSTALL_PROFILE": Var("install", "`all`",
                                   "What `make install` puts into `.venv` beyond the core: `all` (what the "
                                   "tests need), `core`, or extras, comma-separated (`adapters`, `cluster`, "
                                   "`desktop`, `docs`, `e2b`, `test`); `make install-core` etc. set it."),
    "BUNSHIN_CRIU_PREFIX": Var("install", "`/opt/bunshin/criu`", "Where the private CRIU is installed."),
    "BUNSHIN_CRIU_FORCE": Var("install", "`0`", "`1`: reinstall CRIU even if it was verified."),
    "BUNSHIN_CRIU_MIN": Var("install", "`4.2`", "The lowest CRIU version the installer accepts."),
    "BUNSHIN_CRIU_SUITE": Var("install", "`sid`", "The Debian suite CRIU is taken from."),
    "BUNSHIN_DEBIAN_MIRROR": Var("install", "from apt's sources", "The Debian mirror CRIU is fetched from."),
    "BUNSHIN_TEST_SHARED_MACHINE": Var("test", "unset",
                                       "`1`: the tests do not check that the machine was left clean "
                                       "(for several test runs on one machine). `make test` runs the "
                                       "suite on `TEST_WORKERS` (2) workers, each test file whole on one, "
                                       "and checks the machine once over the run; `TEST_WORKERS=0`: one "
                                       "process, checked after every test."),
    "BUNSHIN_TEST_AGENT_ONLY": Var("test", "-", "A marker the agent tests put in the agent's environment."),
    "BUNSHIN_E2B_META": Var("internal", "-",
                            "Set by the E2B envd process wrapper for one command (its metadata); removed "
                            "before the command runs."),
    "BUNSHIN_E2B_STDIN": Var("internal", "-",
                             "Set by the E2B envd process wrapper: `1` when the command takes stdin; removed "
                             "before the command runs."),
    "BUNSHIN_IMAGE": Var("internal", "-",
                         "Set by bunshin in the agent's environment: the image's run config (Env, "
                         "WorkingDir, User)."),
}

#: Names that appear in the code but are no variable (a metavar, a prefix).
NOT_VARIABLES = {"BUNSHIN_SERVE_URL"}


def scan(root: Path) -> dict[str, list[str]]:
    """Each ``BUNSHIN_*`` name in the scanned code -> the files it is in (relative)."""
    found: dict[str, list[str]] = {}
    for top in SCANNED:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in files:
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            for name in set(NAME.findall(text)) - NOT_VARIABLES:
                found.setdefault(name, []).append(path.relative_to(root).as_posix())
    return found


def check(found: dict[str, list[str]]) -> None:
    """Raise when the table and the code disagree."""
    missing = sorted(set(found) - set(VARS))
    stale = sorted(set(VARS) - set(found))
    if missing or stale:
        raise SystemExit(f"docs/gen/envvars.py: variables without a description: {missing or 'none'}; "
                         f"described but not in the code: {stale or 'none'}. Every BUNSHIN_* variable "
                         "needs one row in VARS there (scope, default, meaning): the docs' table of them "
                         "is generated from it")


def render(found: dict[str, list[str]]) -> str:
    check(found)
    out = ["# Environment variables", "",
           "Every `BUNSHIN_*` variable the code reads, generated at build time from a scan of the "
           "code (a variable without a row here fails the docs build). Scope: `user` changes "
           "what bunshin does; `install` is read by `make install` (scripts/); `test` by the test "
           "suite; `internal` is set by bunshin itself.", "",
           "| variable | scope | default | meaning | read in |", "|---|---|---|---|---|"]
    order = {"user": 0, "install": 1, "test": 2, "internal": 3}
    for name in sorted(VARS, key=lambda n: (order[VARS[n].scope], n)):
        v = VARS[name]
        where = ", ".join(f"`{f}`" for f in sorted(found[name])[:3]) + (" ..." if len(found[name]) > 3 else "")
        out.append(f"| `{name}` | {v.scope} | {v.default} | {v.meaning} | {where} |")
    return "\n".join(out) + "\n"
