"""Integration: published ports over HTTP (create's ``publish`` and the ports routes)."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_ports_over_http(served):
    h = {"Authorization": f"Bearer {served.token}"}
    with httpx.Client(base_url=served.url, headers=h, timeout=120) as http:
        bad = http.post("/v1/workspaces", json={"count": 2, "publish": [{"port": 80, "host_port": 8080}]})
        assert bad.status_code == 422 and "leave host_port out" in bad.json()["message"]
        assert http.get("/v1/workspaces").json() == []
        (ws,) = http.post("/v1/workspaces", json={"memory": "256M", "publish": [{"port": 8000}]}).json()
        try:
            (port,) = ws["ports"]
            assert port["host"] == "127.0.0.1" and port["port"] == 8000
            assert http.get(f"/v1/workspaces/{ws['id']}/ports").json() == [port]
            assert http.post(f"/v1/workspaces/{ws['id']}/exec", json={
                "command": "mkdir -p /srv && echo hi > /srv/x"}).json()["exit_code"] == 0
            http.post(f"/v1/workspaces/{ws['id']}/spawn", json={
                "command": ["python3", "-m", "http.server", "8000", "--bind", "127.0.0.1"], "cwd": "/srv"})
            r = http.post(f"/v1/workspaces/{ws['id']}/exec", json={"command": [
                "python3", "-c", "import socket, time\nfor _ in range(300):\n try:\n"
                "  socket.create_connection(('127.0.0.1', 8000), 1).close(); break\n"
                " except OSError: time.sleep(0.05)\nelse: raise SystemExit(1)"]})
            assert r.json()["exit_code"] == 0, r.text
            assert httpx.get(f"http://127.0.0.1:{port['host_port']}/x", timeout=10).text == "hi\n"
            taken = http.post(f"/v1/workspaces/{ws['id']}/ports", json={"port": 8000, "host_port": port["host_port"]})
            assert taken.status_code == 409 and "in use" in taken.json()["message"]
            privileged = http.post(f"/v1/workspaces/{ws['id']}/ports", json={"port": 8000, "host_port": 80})
            assert privileged.status_code == 422 and "host_port" in privileged.json()["message"], privileged.text
            other = http.post(f"/v1/workspaces/{ws['id']}/ports", json={"port": 9}).json()
            assert http.delete(f"/v1/workspaces/{ws['id']}/ports/{other['host_port']}").status_code == 204
            assert http.get(f"/v1/workspaces/{ws['id']}/ports").json() == [port]
            assert http.delete(f"/v1/workspaces/{ws['id']}/ports/{other['host_port']}").status_code == 404
        finally:
            http.delete(f"/v1/workspaces/{ws['id']}")


def test_network_fields_are_checked():
    from pydantic import ValidationError

    from bunshin.api import models as m

    assert m.CreateWorkspace(network="egress", allow=["203.0.113.0/24", "198.51.100.7"]).network == "egress"
    for bad, says in (({"network": "bridge"}, "network"), ({"network": "egress", "allow": ["no such thing!"]}, "not a CIDR"),
                      ({"network": "none", "deny": ["10.0.0.0/8"]}, "need network 'egress'")):
        with pytest.raises(ValidationError) as err:
            m.CreateWorkspace(**bad)
        assert says in str(err.value)
    with pytest.raises(ValidationError):
        m.NetworkPolicyIn(allow=["-bad-.com"])


def test_the_servers_ceiling_and_default(no_leaks):
    from bunshin.errors import InvalidArgument
    from bunshin.server.context import ServerContext

    closed = ServerContext(no_leaks, "t")
    assert closed.network_mode(None) == "none" and closed.network_mode("none") == "none"
    with pytest.raises(InvalidArgument) as err:
        closed.network_mode("egress")
    assert "--network egress" in err.value.hint
    opened = ServerContext(no_leaks, "t", network="egress", network_default="egress")
    assert opened.network_mode(None) == "egress" and opened.network_mode("none") == "none"
    with pytest.raises(InvalidArgument):
        ServerContext(no_leaks, "t", network_default="egress")


def test_network_over_http(no_leaks, internet):
    from bunshin.server.thread import serve_in_thread

    h = {"Authorization": "Bearer tok-0123456789abcdef"}
    with serve_in_thread(no_leaks, "tok-0123456789abcdef") as url, httpx.Client(base_url=url, headers=h, timeout=120) as http:
        refused = http.post("/v1/workspaces", json={"network": "egress"})
        assert refused.status_code == 400 and "no egress" in refused.json()["message"]
    with serve_in_thread(no_leaks, "tok-0123456789abcdef", network="egress") as url, \
            httpx.Client(base_url=url, headers=h, timeout=120) as http:
        (ws,) = http.post("/v1/workspaces", json={"memory": "256M", "network": "egress",
                                                  "deny": [internet.other]}).json()
        (plain,) = http.post("/v1/workspaces", json={"memory": "256M"}).json()  # the default: none
        try:
            net = http.get(f"/v1/workspaces/{ws['id']}/network").json()
            assert net["network"] == "egress" and net["address"] and net["deny"] == [f"{internet.other}/32"]
            assert http.get(f"/v1/workspaces/{plain['id']}/network").json()["network"] == "none"
            put = http.put(f"/v1/workspaces/{ws['id']}/network", json={"allow": [internet.subnet]})
            assert put.status_code == 200 and put.json()["allow"] == [internet.subnet] and put.json()["deny"] == []
            bad = http.put(f"/v1/workspaces/{ws['id']}/network", json={"allow": ["a..b"]})
            assert bad.status_code == 422
            assert http.get(f"/v1/workspaces/{ws['id']}/network").json()["allow"] == [internet.subnet]
            none = http.put(f"/v1/workspaces/{plain['id']}/network", json={"allow": [internet.subnet]})
            assert none.status_code == 409 and none.json()["hint"]
        finally:
            for w in (ws, plain):
                http.delete(f"/v1/workspaces/{w['id']}")
        # the same through the Python client
        from bunshin.client import Client
        from bunshin.errors import InvalidArgument

        client = Client(url, token="tok-0123456789abcdef")
        with pytest.raises(InvalidArgument):
            client.create(network="egress", allow=["x..y"])  # refused before anything is sent
        rw = client.create(memory="256M", network="egress", deny=[internet.other])
        try:
            assert rw.network().deny == [f"{internet.other}/32"]
            assert rw.set_network_policy(allow=[internet.subnet]).allow == [internet.subnet]
            p = rw.publish(9)
            assert rw.published() == [p] and p.host == "127.0.0.1"
            rw.unpublish(p.host_port)
            assert rw.published() == []
        finally:
            rw.remove()
