"""The bunshin hosts of a Ray cluster: one :class:`~bunshin.cluster.actor.HostActor` per node.

Ray is imported here, lazily (``pip install 'bunshin[cluster]'``). The actors are
detached and named per node (namespace ``bunshin``), so ``bunshin cluster up``,
``status`` and ``down`` may run from different processes; each is pinned to its node
(``NodeAffinitySchedulingStrategy``, no CPU taken). Rollout traffic does not go
through Ray: the head talks HTTP to each host's server (:meth:`Cluster.clients`).

Nothing secret crosses Ray: the head and every host read the cluster secret from their
own file (:mod:`bunshin.cluster.secret`; only its path is an actor's argument) and derive
the servers' tokens, the snapshot key and the fencing key from it. A host's URL comes
from its actor signed, so the head sends a token only where a holder of the secret said.
Ray itself must authenticate its callers: :meth:`Cluster.up` refuses a Ray cluster
without token authentication (``RAY_AUTH_MODE=token``) unless told otherwise.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import (
    BunshinError,
    HostUnsupported,
    InvalidArgument,
    RuntimeFailure,
    Unauthorized,
    Unreachable,
)
from . import fence
from .records import Endpoint, HostInfo, HostLimits, SignedEndpoint
from .secret import ClusterSecret

if TYPE_CHECKING:
    from ..client import Client

NAMESPACE = "bunshin"
ACTOR_PREFIX = "bunshin-host-"
#: A node's custom resource ``bunshin-host-NAME`` names its host NAME (else its node id's head).
RESOURCE_PREFIX = "bunshin-host-"
CALL_TIMEOUT_S = 30.0
START_TIMEOUT_S = 120.0
#: ``--bind`` that means each node's own Ray address (``ray start --node-ip-address``).
BIND_RAY = "ray"
LOOPBACK = "127.0.0.1"


def ray_module() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise HostUnsupported("bunshin cluster needs Ray", hint="pip install 'bunshin[cluster]' "
                                                                "(make install puts it in .venv)") from None
    return ray


def connect_ray(address: str | None = "auto") -> ModuleType:
    """Ray, connected: to the running cluster at ``address`` ("auto": the one on this
    machine), or a new local one for ``None``. A connection already made is kept."""
    ray = ray_module()
    if ray.is_initialized():
        return ray
    _probe(address)
    try:
        if address is None:
            ray.init(namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as e:
        raise Unreachable(f"no Ray cluster at {address}: {e}",
                          hint="start one: `ray start --head` here and `ray start --address=HEAD:6379` on each "
                               "host") from None
    return ray


def _probe(address: str | None) -> None:
    """A HOST:PORT nobody answers on is an error now (Ray itself would retry for minutes)."""
    if address is None or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except ValueError:
        raise InvalidArgument(f"Ray address {address!r}", hint="give HOST:PORT of the head's GCS, or auto") from None
    except OSError as e:
        raise Unreachable(f"no Ray cluster at {address}: {e.strerror or e}",
                          hint="start one: `ray start --head` here and `ray start --address=HEAD:6379` on each "
                               "host") from None


def ray_auth_enabled() -> bool:
    """Does this process speak to Ray with token authentication? Connected without it,
    its Ray cluster has none (one that has refuses such a driver)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication (< 2.52)
        return False
    return bool(is_token_auth_enabled())


def _bind_for(bind: str | None, nodes: list[Node]) -> dict[str, str]:
    """What each node's server binds (an address, or an interface its actor resolves):
    loopback when every node is on this machine; else the operator names it."""
    machines = {n.address for n in nodes}
    if bind is None:
        if len(machines) > 1:
            raise InvalidArgument(f"the Ray nodes are on {len(machines)} machines: their servers must listen where "
                                  "the head reaches them", hint="name it: --bind IFACE (an interface of the "
                                  "cluster's own network, e.g. wg0), --bind ADDR, or --bind ray (each node's Ray "
                                  "address)")
        bind = LOOPBACK
    return {n.node_id: n.address if bind == BIND_RAY else bind for n in nodes}


@dataclass(frozen=True)
class Node:
    """A live Ray node and the host name it carries."""

    node_id: str
    name: str
    address: str

    @property
    def actor_name(self) -> str:
        return f"{ACTOR_PREFIX}{self.node_id}"


def host_name(node: dict[str, Any]) -> str:
    for res in node.get("Resources", {}):
        if res.startswith(RESOURCE_PREFIX):
            return str(res[len(RESOURCE_PREFIX):])
    return str(node["NodeID"])[:8]


def live_nodes(ray: ModuleType) -> list[Node]:
    nodes = [Node(n["NodeID"], host_name(n), n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")]
    names = [n.name for n in nodes]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise InvalidArgument(f"two Ray nodes carry the host name {dup[0]!r}",
                              hint=f"give each node its own resource {RESOURCE_PREFIX}NAME")
    return sorted(nodes, key=lambda n: n.name)


class Cluster:
    """The hosts of the Ray cluster this process is connected to; ``secret_file``: this
    machine's copy of the cluster secret (default :func:`bunshin.cluster.secret.default_path`),
    read when first needed."""

    def __init__(self, ray: ModuleType, secret_file: Path | None = None) -> None:
        self._ray = ray
        self._secret_file = secret_file
        self._secret: ClusterSecret | None = None

    @property
    def secret(self) -> ClusterSecret:
        if self._secret is None:
            self._secret = ClusterSecret.load(self._secret_file)
        return self._secret

    # --- lifecycle --------------------------------------------------------------------

    @classmethod
    def up(cls, *, address: str | None = "auto", home_root: Path | None = None, bind: str | None = None,
           limits: HostLimits | None = None, secret_file: Path | None = None, lease_s: float | None = None,
           allow_unauthenticated_ray: bool = False) -> Cluster:
        """A host actor (and its ``bunshin serve``) on every live node that has none yet.

        ``home_root``: each node's home is ``home_root/NAME`` (several hosts on one
        machine), else the node's own ``BUNSHIN_HOME``. ``bind``: what the servers listen
        on: an address, an interface name (resolved on each node) or ``ray`` (each node's
        Ray address); default loopback, which only a cluster on one machine may use.
        ``secret_file``: the cluster secret, at this path on the head and on every host.
        ``lease_s``: how long a host's lease lasts unrenewed
        (:data:`bunshin.cluster.fence.LEASE_S`). A Ray cluster without token
        authentication is refused unless ``allow_unauthenticated_ray``."""
        secret = ClusterSecret.load(secret_file)  # the head's copy: missing is an error before anything starts
        ray = connect_ray(address)
        if not allow_unauthenticated_ray and not ray_auth_enabled():
            raise Unauthorized("this Ray cluster does not authenticate its callers: anyone who reaches it runs "
                               "code as root on every host",
                               hint="start Ray with RAY_AUTH_MODE=token and its token on every node and here "
                                    "(`ray get-auth-token --generate`; see the README's cluster section), or "
                                    "--allow-unauthenticated-ray on a network of the hosts alone")
        cluster = cls(ray, secret.path)
        cluster._secret = secret
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .actor import HostActor

        remote = ray.remote(HostActor)
        started: list[tuple[Node, Any]] = []
        nodes = live_nodes(ray)
        if home_root is None and len({n.address for n in nodes}) < len(nodes):
            raise InvalidArgument("several Ray nodes run on one machine: their hosts would share its BUNSHIN_HOME",
                                  hint="give each its own home: --home-root DIR (home_root=) makes DIR/NAME")
        binds = _bind_for(bind, nodes)
        for node in nodes:
            if cluster._actor(node) is not None:
                continue
            home = str(home_root / node.name) if home_root is not None else None
            handle = remote.options(
                name=node.actor_name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            ).remote(node.name, node.node_id, home, bind=binds[node.node_id], secret_file=str(secret.path.absolute()),
                     limits=vars(limits or HostLimits()), lease_s=lease_s or fence.LEASE_S)
            started.append((node, handle))
        errors = []
        for node, handle in started:  # the constructor started the server: wait for it
            try:
                ray.get(handle.endpoint.remote(), timeout=START_TIMEOUT_S)
            except Exception as e:
                errors.append(f"{node.name}: {_cause(e)}")
                ray.kill(handle)
        if errors:
            raise RuntimeFailure(f"{len(errors)} host(s) did not start: {'; '.join(errors)}",
                                 hint="see cluster-serve.log in each host's home")
        return cluster

    @classmethod
    def connect(cls, address: str | None = "auto", *, secret_file: Path | None = None) -> Cluster:
        """The hosts ``bunshin cluster up`` started."""
        return cls(connect_ray(address), secret_file)

    def down(self) -> list[str]:
        """Stop every host's server (workspaces and records stay for its next start) and
        its actor; the names of the hosts stopped."""
        stopped = []
        for node, actor in self._actors():
            try:
                self._ray.get(actor.stop.remote(), timeout=CALL_TIMEOUT_S)
            except Exception:  # a dead actor is stopped already
                pass
            self._ray.kill(actor)
            stopped.append(node.name)
        return stopped

    # --- what the head uses -------------------------------------------------------------

    def nodes(self) -> list[Node]:
        return live_nodes(self._ray)

    def actor(self, name: str) -> Any:
        """The actor of host ``name``."""
        for node, actor in self._actors():
            if node.name == name:
                return actor
        raise InvalidArgument(f"no host {name!r} in the cluster", hint="see `bunshin cluster status`")

    def reclaim(self, name: str) -> dict[str, int]:
        """Host ``name`` came back after the head gave up on it: its server stopped, its
        home emptied (workspaces, snapshots, gc) and its server started again."""
        removed: dict[str, int] = self._ray.get(self.actor(name).reclaim.remote(), timeout=START_TIMEOUT_S)
        return removed

    def fence(self, name: str) -> int:
        """The head gives host ``name``'s current epoch up (its work is retried elsewhere):
        its actor empties its home and serves again in the new epoch; that epoch."""
        return fence.fence(self.secret, name)

    def live(self) -> set[str]:
        """The hosts whose Ray node the GCS counts alive (a node cut off from it is counted
        dead after Ray's health checks fail: ``health_check_*`` in Ray's system config)."""
        return {n.name for n in self.nodes()}

    def serving(self, name: str) -> int | None:
        """The epoch host ``name`` serves now (emptied of everything older)."""
        return fence.serving(self.secret, name)

    def endpoint(self, name: str) -> Endpoint | None:
        """URL and token of host ``name`` (``None``: its actor does not answer, or what it
        answers is not signed with the cluster secret)."""
        secret = self.secret  # first: no secret here is an error, not a host that does not answer
        try:
            return self._access(self._ray.get(self.actor(name).endpoint.remote(), timeout=CALL_TIMEOUT_S), secret)
        except Exception:
            return None

    @staticmethod
    def _access(signed: SignedEndpoint, secret: ClusterSecret) -> Endpoint | None:
        """The head's way to the server ``signed`` names: its token derived here."""
        s = signed
        if not secret.verify(s.mac, "endpoint", s.name, s.url, s.epoch):
            fence.reject(f"endpoint/{s.name}", "its actor's endpoint is not signed with the cluster secret")
            return None
        return Endpoint(s.name, s.url, secret.host_token(s.name, s.epoch))

    def status(self) -> list[HostInfo]:
        """Every live node's host; a node without an answering actor is reported dead."""
        out = []
        for node in self.nodes():
            actor = self._actor(node)
            if actor is None:
                out.append(_dead(node, "no host actor: run `bunshin cluster up`"))
                continue
            try:
                out.append(HostInfo.from_dict(self._ray.get(actor.status.remote(), timeout=CALL_TIMEOUT_S)))
            except Exception as e:
                out.append(_dead(node, _cause(e)))
        return out

    def endpoints(self) -> list[Endpoint]:
        """URL and token of every host whose actor answers."""
        secret = self.secret  # first: no secret here is an error, not hosts that do not answer

        def one(actor: Any) -> Endpoint | None:
            try:
                return self._access(self._ray.get(actor.endpoint.remote(), timeout=CALL_TIMEOUT_S), secret)
            except Exception:
                return None

        actors = [a for _, a in self._actors()]
        with ThreadPoolExecutor(max(1, len(actors))) as pool:
            return [e for e in pool.map(one, actors) if e is not None]

    def clients(self, *, timeout: float | None = 300.0) -> dict[str, Client]:
        """A :class:`bunshin.client.Client` per host, by name (close them when done)."""
        from ..client import Client, Retry
        from .transport import keepalive_transport

        return {e.name: Client(e.url, token=e.token, timeout=timeout, retry=Retry(total_s=60.0),
                               transport=keepalive_transport()) for e in self.endpoints()}

    # --- internals ------------------------------------------------------------------------

    def _actor(self, node: Node) -> Any | None:
        try:
            return self._ray.get_actor(node.actor_name, namespace=NAMESPACE)
        except ValueError:
            return None

    def _actors(self) -> list[tuple[Node, Any]]:
        return [(n, a) for n in self.nodes() if (a := self._actor(n)) is not None]


def _dead(node: Node, error: str) -> HostInfo:
    return HostInfo(name=node.name, node_id=node.node_id, url="", home="", alive=False, pid=None,
                    free_memory=0, total_memory=0, load=0.0, workspaces=0, error=error)


def _cause(e: BaseException) -> str:
    """The bunshin error inside a Ray task error, else its first line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BunshinError):
        return str(cause)
    return (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
