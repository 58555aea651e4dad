"""Routes of a workspace's network: its egress policy and its published ports.

``GET /v1/workspaces/{id}/network`` says its mode, address and policy; ``PUT`` replaces
the policy of a running workspace with egress (its clones keep theirs).

``POST /v1/workspaces/{id}/ports`` publishes a port on the server host's loopback (the
forwarder of ``runtime.container.publish``), ``GET`` lists them, ``DELETE
/v1/workspaces/{id}/ports/{host_port}`` stops one."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..api import models as m
from ..runtime.container.publish import Published
from ..runtime.net.policy import NetworkMode
from ..workspace import Workspace
from .context import ServerContext


def port_out(p: Published) -> m.PortOut:
    return m.PortOut(port=p.port, host=p.host, host_port=p.host_port)


def publish_all(ws: Workspace, wanted: list[m.PublishPort]) -> list[m.PortOut]:
    """Publish each of ``wanted`` on ``ws`` (loopback only); the first failure raises."""
    return [port_out(ws.publish(p.port, p.host_port)) for p in wanted]


def network_out(ws: Workspace) -> m.NetworkOut:
    policy = ws.network_policy()
    if policy is None:
        return m.NetworkOut(network=NetworkMode.NONE.value)
    return m.NetworkOut(network=NetworkMode.EGRESS.value, address=ws.network_address(),
                        allow=[*policy.allow_cidrs, *policy.allow_names], deny=[*policy.deny_cidrs, *policy.deny_names])


def router(ctx: ServerContext) -> APIRouter:
    r = APIRouter(prefix="/v1")
    ws_of = ctx.ws_of

    @r.get("/workspaces/{ws_id}/network")
    def network(ws_id: str) -> m.NetworkOut:
        return network_out(ws_of(ws_id))

    @r.put("/workspaces/{ws_id}/network")
    def set_network(ws_id: str, req: m.NetworkPolicyIn) -> m.NetworkOut:
        ws = ws_of(ws_id)
        ws.set_network_policy(req.allow, req.deny)
        return network_out(ws)

    @r.get("/workspaces/{ws_id}/ports")
    def ports(ws_id: str) -> list[m.PortOut]:
        return [port_out(p) for p in ws_of(ws_id).published()]

    @r.post("/workspaces/{ws_id}/ports", status_code=201)
    def publish(ws_id: str, req: m.PublishPort) -> m.PortOut:
        return port_out(ws_of(ws_id).publish(req.port, req.host_port))

    @r.delete("/workspaces/{ws_id}/ports/{host_port}", status_code=204)
    def unpublish(ws_id: str, host_port: int) -> Response:
        ws_of(ws_id).unpublish(host_port)
        return Response(status_code=204)

    return r
