"""Host-name mode over TLS: ``bunshin serve --tls-cert/--tls-key --e2b-domain`` and the
unmodified e2b SDK reaching envd at ``https://49983-<id>.<domain>`` and a port inside at
``get_host(port)`` (HTTPS, and a websocket over wss), with a CA and a wildcard certificate
the test makes. The names resolve through an /etc/hosts of the test's own, bind-mounted in a private mount namespace of the
client's process: the host's /etc/hosts and DNS are never touched. All on loopback."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("e2b")

from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import drop_everything  # noqa: E402

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not shutil.which("openssl") or not shutil.which("unshare"),
                                 reason="needs openssl and unshare (util-linux)")]

DOMAIN = "e2b.test"
ROOT = Path(__file__).resolve().parents[3]
CLIENT = Path(__file__).with_name("hostname_client.py")


def _certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for *.DOMAIN, api.DOMAIN and 127.0.0.1."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1")  # quick to make, unlike RSA
    openssl("req", "-x509", *ec, "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=bunshin test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign")
    openssl("req", *ec, "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN=*.{DOMAIN}")
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:*.{DOMAIN},DNS:api.{DOMAIN},IP:127.0.0.1\n"
                               "extendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return d / "ca.pem", d / "server.pem", d / "server.key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_hostname_mode_over_tls(cfg, tmp_path: Path) -> None:
    ca, cert, key = _certs(tmp_path)
    trust = ssl.create_default_context(cafile=str(ca))
    port = _free_port()
    token = "test-token-hostname-mode-0123456789"
    (tmp_path / "token").write_text(token)
    os.chmod(tmp_path / "token", 0o600)
    env = {**os.environ, "BUNSHIN_HOME": str(cfg.home), "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen(
        [sys.executable, "-m", "bunshin.cli.main", "serve", "--port", str(port), "--token-file",
         str(tmp_path / "token"), "--tls-cert", str(cert), "--tls-key", str(key), "--e2b-domain",
         f"{DOMAIN}:{port}", "--shutdown-grace", "5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"https://127.0.0.1:{port}/v1/health", verify=trust).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert serve.poll() is None and time.monotonic() < deadline, serve.stderr.read() if serve.stderr else ""
            time.sleep(0.1)
        api = f"https://api.{DOMAIN}:{port}"
        # a workspace made by bunshin's own API is a sandbox to the SDK too (no template boot)
        made = httpx.post(f"https://127.0.0.1:{port}/v1/workspaces", json={"image": "host", "memory": "1G"},
                          headers={"Authorization": f"Bearer {token}"}, verify=trust, timeout=60)
        assert made.status_code == 201, made.text
        sid = made.json()[0]["id"]
        hosts = tmp_path / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 api.{DOMAIN} 49983-{sid}.{DOMAIN} 8123-{sid}.{DOMAIN} 8124-{sid}.{DOMAIN}\n")
        script = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
        client_env = {**env, "E2B_API_KEY": token, "SSL_CERT_FILE": str(ca), "E2B_DEBUG": ""}
        run = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(hosts),
             sys.executable, str(CLIENT), api, DOMAIN, sid],
            env=client_env, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        with contextlib.suppress(httpx.HTTPError):
            drop_everything(f"https://127.0.0.1:{port}", token, verify=trust)
        serve.terminate()
        serve.wait(60)
    assert leftovers(cfg) == {}
    assert out["envd_url"].startswith("https://49983-ws-") and out["envd_url"].endswith(f".{DOMAIN}:{port}")
    assert out["run"].startswith("over-tls\n")
    assert out["read"] == "port inside"
    assert out["signed"] == "port inside"  # a signed download URL, fetched by its host name alone
    assert out["host"].startswith("8123-ws-")
    assert out["proxied"] == [200, "port inside"]
    assert out["no_token"] == 401
    assert out["wss"] == ["over wss", [0, 255]]
    assert "e2b.test" not in Path("/etc/hosts").read_text()  # the host's own was never touched
