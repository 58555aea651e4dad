"""The unmodified e2b SDK in host-name mode (no ``sandbox_url``): run by test_envd_hosts.py in a
private mount namespace whose /etc/hosts is the test's own file, naming the sandbox it made
(there is no wildcard in /etc/hosts, and the SDK's resolver reads it once). Connects to that
sandbox, uses it (a port inside over HTTPS and over wss), kills it; prints one JSON line of results."""

from __future__ import annotations

import json
import sys
import time

import httpx
from e2b import Sandbox
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.server.e2b.ws_inside import start_echo

api_url, domain, sandbox_id = sys.argv[1], sys.argv[2], sys.argv[3]
out: dict[str, object] = {}
sbx = Sandbox.connect(sandbox_id, api_url=api_url, domain=domain)
try:
    out["envd_url"] = sbx.envd_api_url
    out["run"] = sbx.commands.run("echo over-tls; hostname").stdout
    sbx.files.write("/srv/index.html", "port inside")
    out["read"] = sbx.files.read("/srv/index.html")
    out["signed"] = httpx.get(sbx.download_url("/srv/index.html")).text  # no token: the URL's signature
    server = sbx.commands.run("cd /srv && exec python3 -m http.server 8123 --bind 127.0.0.1", background=True)
    host = sbx.get_host(8123)
    out["host"] = host
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(f"https://{host}/index.html", headers={"E2B-Traffic-Access-Token": sbx.traffic_access_token})
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out["proxied"] = [r.status_code, r.text]
    out["no_token"] = httpx.get(f"https://{host}/index.html").status_code
    server.kill()
    server.disconnect()
    # a websocket, wss:// to get_host(port) as any client would (the name from /etc/hosts, the CA from SSL_CERT_FILE)
    echo = start_echo(sbx, 8124)
    token = {"E2B-Traffic-Access-Token": sbx.traffic_access_token}
    while True:
        try:
            with connect(f"wss://{sbx.get_host(8124)}/echo", additional_headers=token, proxy=None) as ws:
                ws.send("over wss")
                ws.send(b"\x00\xff")
                out["wss"] = [ws.recv(timeout=10), list(ws.recv(timeout=10))]
            break
        except InvalidStatus as e:
            if e.response.status_code != 502 or time.monotonic() > deadline + 15:
                raise
            time.sleep(0.1)
    echo.kill()
finally:
    sbx.kill()
print(json.dumps(out))
