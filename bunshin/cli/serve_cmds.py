"""``bunshin serve``: the workspace API over HTTP."""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path

from .. import console as output
from ..config import Config
from ..errors import InvalidArgument

DEFAULT_PORT = 8770
#: ``--max-upload``'s default: all uploads in flight together.
DEFAULT_MAX_UPLOAD = "32G"
#: ``--threads`` and ``--sandbox-threads``' defaults (``server.shares.THREADS``, ``SANDBOX_THREADS``:
#: not imported here, the CLI's start stays light; a test holds them equal).
DEFAULT_THREADS, DEFAULT_SANDBOX_THREADS = 256, 8


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve this host's workspaces over HTTP (bearer token)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--token-file", type=Path, default=None,
                   help="the API token (made, mode 0600, if missing; default BUNSHIN_HOME/server.token)")
    p.add_argument("--max-workspaces", type=int, default=None, metavar="N",
                   help="refuse (429) creates and forks past N live workspaces on this host")
    p.add_argument("--max-memory", default="auto", metavar="SIZE",
                   help="refuse (429) creates, forks and restores past this sum of memory limits, e.g. 48G "
                        "(default auto: the host's memory; 'off' for none: copy-on-write clones share pages, "
                        "so their limits overstate them)")
    p.add_argument("--max-pids", default="auto", metavar="N",
                   help="refuse (429) creates, forks and restores past this sum of pids limits (default auto "
                        "and at most: kernel.pid_max less 10%%, the host-wide budget)")
    p.add_argument("--reserve-memory", default="auto", metavar="SIZE",
                   help="refuse (429) creates and forks while the host has less memory available than "
                        "this (default auto: 5%% of its memory, at least 512M; 'off' for none)")
    p.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                   help="lease of workspaces made without a ttl of their own: removed after this "
                        "unless renewed (default: none, they live until removed)")
    p.add_argument("--shutdown-grace", type=float, default=60.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long calls in flight may finish before they are cut "
                        "(default 60); workspaces and records stay for the next start")
    p.add_argument("--rate", type=float, default=None, metavar="PER_S",
                   help="workspaces made per second (creates, forks, restores; token bucket)")
    p.add_argument("--burst", type=int, default=8, help="workspaces made at once under --rate (default 8)")
    p.add_argument("--max-upload", default=DEFAULT_MAX_UPLOAD, metavar="SIZE",
                   help="bytes of all uploads in flight together (snapshots, image layers, file bodies; "
                        f"413 for one over it, 429 while others hold it; default {DEFAULT_MAX_UPLOAD}, 'off' "
                        "for none); the disk's free space bounds them too")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                   help=f"the thread pool of blocking calls (default {DEFAULT_THREADS}); E2B sandboxes' calls "
                        "take at most half of it together, so the other half always serves the API")
    p.add_argument("--sandbox-threads", type=int, default=DEFAULT_SANDBOX_THREADS, metavar="N",
                   help="threads one E2B sandbox's calls (envd, code interpreter, ports) hold at once "
                        f"(default {DEFAULT_SANDBOX_THREADS}); more wait, past 64 waiting they are refused (429)")
    p.add_argument("--network", choices=("none", "egress"), default="none",
                   help="the most network a workspace may ask for: none (loopback only, the default) or egress")
    p.add_argument("--network-default", choices=("none", "egress"), default="none",
                   help="the network of a workspace whose request does not say (at most --network; default none)")
    p.add_argument("--e2b-domain", default=None, metavar="DOMAIN",
                   help="the sandbox domain E2B's API answers: the SDK reaches a sandbox's port P at "
                        "<P>-<sandbox id>.DOMAIN (wildcard DNS to this server; default localhost:<port>)")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="serve HTTPS with this certificate chain (with --tls-key); for E2B's host-name mode "
                        "it must cover *.DOMAIN of --e2b-domain")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..server import create_app, ensure_token
    from ..server.admission import Limits
    from ..server.thread import listening_socket

    cfg = Config.from_env()
    limits = Limits(max_workspaces=args.max_workspaces, max_memory=_max_memory(args.max_memory),
                    reserve_memory=_reserve(args.reserve_memory), rate=args.rate, burst=args.burst,
                    max_upload=_size_or_off(args.max_upload, "--max-upload"), max_pids=_max_pids(args.max_pids))
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidArgument("--tls-cert and --tls-key go together", hint="give both, or neither for plain HTTP")
    for f in (args.tls_cert, args.tls_key):
        if f is not None and not f.is_file():
            raise InvalidArgument(f"{f} is not a file", hint="give the PEM files of the certificate and its key")
    scheme = "https" if args.tls_cert else "http"
    token_file = args.token_file or cfg.paths.server_token
    token = ensure_token(token_file)
    if not _loopback(args.host) and not args.tls_cert:
        output.err.print(f"[yellow]listening on {args.host}: anyone who reaches it and holds the token "
                         "drives this host's workspaces; put TLS in front of it[/yellow]")
    output.err.print(f"bunshin serve: {scheme}://{args.host}:{args.port}  (token: {token_file}; docs: /docs)")
    sock = listening_socket(args.host, args.port)
    try:
        app = create_app(cfg, token, limits=limits, default_ttl=args.ttl, e2b_domain=args.e2b_domain,
                         network=args.network, network_default=args.network_default, threads=args.threads,
                         sandbox_threads=args.sandbox_threads)
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=args.shutdown_grace,
                                      ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key)).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _size_or_off(text: str, option: str) -> int | None:
    """A size such as 48G, or None for 'off'."""
    from ..runtime.kernel.limits import byte_size

    return None if text == "off" else byte_size(text, option, "give a size like 48G, or 'off'")


def _max_memory(text: str) -> int | None:
    """``--max-memory``: 'auto' (the host's memory), 'off', or a size (more than the host's
    memory is an overcommit: the operator's choice)."""
    from ..server.admission import Limits

    return Limits.of_host().max_memory if text == "auto" else _size_or_off(text, "--max-memory")


def _max_pids(text: str) -> int | None:
    """``--max-pids``: 'auto' (the host-wide pids budget), or a number within it."""
    from ..errors import InvalidArgument
    from ..runtime.state import budget

    most = budget.pids_budget()
    if text == "auto":
        return most
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise InvalidArgument(f"--max-pids {text!r} is not a number from 1 to {most}",
                              hint="kernel.pid_max less 10% is the host-wide budget; raise kernel.pid_max for more")
    return int(text)


def _reserve(text: str) -> int | None:
    """``--reserve-memory``: 'auto' (5% of the host's memory, at least 512 MiB), 'off', or a size."""
    from ..errors import InvalidArgument
    from ..runtime.container.cgroups import parse_size
    from ..server.admission import Limits

    if text == "off":
        return None
    if text == "auto":
        return Limits.of_host().reserve_memory
    size = parse_size(text)
    if size is None:
        raise InvalidArgument(f"--reserve-memory {text!r}", hint="give a size like 2G, or 'auto' or 'off'")
    return size


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
