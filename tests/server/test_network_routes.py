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
            other = http.post(f"/v1/workspaces/{ws['id']}/ports", json={"port": 9}).json()
            assert http.delete(f"/v1/workspaces/{ws['id']}/ports/{other['host_port']}").status_code == 204
            assert http.get(f"/v1/workspaces/{ws['id']}/ports").json() == [port]
            assert http.delete(f"/v1/workspaces/{ws['id']}/ports/{other['host_port']}").status_code == 404
        finally:
            http.delete(f"/v1/workspaces/{ws['id']}")
