"""The servers of the test internet, run as one process inside its own network namespace.

Started by ``internet.Internet`` as ``unshare --net python inet_servers.py SPEC`` (run by
path: it imports only the standard library, and dnspython for DNS when installed). It
prints ``netns``, waits for ``go`` on stdin (the parent moves the link in and sets the addresses first),
binds, prints ``ready`` and serves until stdin closes: when its parent dies the pipe
closes, this process exits, and the kernel destroys the namespace with the link in it.

SPEC (JSON): ``web``: addresses of HTTP servers on port 80 serving ``files`` and the
generated routes; ``index``: address of the package index (PEP 503) over ``wheels``;
``dns``: address of the DNS server (UDP and TCP 53) answering from the JSON file
``names``; ``log``: a file of JSON lines, one per request and per DNS query.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import socketserver
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_BLOCK = bytes(range(256)) * 257  # a known pattern: byte i of a stream is i % 256 (64 KiB + one turn)
_LOG_LOCK = threading.Lock()


def _log(log_file: str, /, **entry: Any) -> None:
    entry["t"] = time.time()
    with _LOG_LOCK, open(log_file, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    spec: dict[str, Any] = {}
    role = "web"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        sent, error = 0, None
        try:
            sent = self._route(url.path, query)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as e:
            error = type(e).__name__
        _log(self.spec["log"], kind="http", server=self.connection.getsockname()[0], client=self.client_address[0],
             port=self.client_address[1], path=self.path, sent=sent, error=error)

    def _route(self, path: str, query: dict[str, str]) -> int:
        if self.role == "index":
            return self._index(path)
        if path == "/whoami":
            return self._send(200, self.client_address[0].encode())
        if m := re.fullmatch(r"/bytes/(\d+)", path):
            return self._stream(int(m[1]), 0.0)
        if m := re.fullmatch(r"/slow/(\d+)", path):
            return self._stream(int(m[1]), float(query.get("rate", 256 * 1024)))
        if path.startswith("/files/"):
            return self._file(Path(self.spec["files"]), path[len("/files/"):])
        return self._send(404, b"not found\n")

    def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> int:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        return len(body)

    def _stream(self, size: int, rate: float) -> int:
        """``size`` bytes of the pattern; at ``rate`` bytes/s in 16 KiB pieces when > 0."""
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.end_headers()
        sent, t0, piece = 0, time.monotonic(), 16384 if rate else 65536
        view = memoryview(_BLOCK)
        while sent < size:
            n = min(piece, size - sent)
            self.wfile.write(view[sent % 256: sent % 256 + n])
            sent += n
            if rate and (ahead := sent / rate - (time.monotonic() - t0)) > 0:
                time.sleep(ahead)
        return sent

    def _file(self, root: Path, rel: str) -> int:
        target = (root / urllib.parse.unquote(rel)).resolve()
        if not target.is_file() or not target.is_relative_to(root.resolve()):
            return self._send(404, b"not found\n")
        return self._send(200, target.read_bytes(), "application/octet-stream")

    def _index(self, path: str) -> int:
        wheels = sorted(Path(self.spec["wheels"]).glob("*.whl"))
        projects: dict[str, list[Path]] = {}
        for w in wheels:
            projects.setdefault(_normalize(w.name.split("-")[0]), []).append(w)
        if path in ("/simple", "/simple/"):
            links = "".join(f'<a href="/simple/{p}/">{p}</a>\n' for p in sorted(projects))
            return self._send(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode(), "text/html")
        if m := re.fullmatch(r"/simple/([^/]+)/?", path):
            files = projects.get(_normalize(m[1]))
            if not files:
                return self._send(404, b"no such project\n")
            links = "".join(
                f'<a href="/packages/{html.escape(w.name)}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}">'
                f"{html.escape(w.name)}</a>\n" for w in files)
            return self._send(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode(), "text/html")
        if path.startswith("/packages/"):
            return self._file(Path(self.spec["wheels"]), path[len("/packages/"):])
        return self._send(404, b"not found\n")


def _answer(spec: dict[str, Any], wire: bytes, client: str) -> bytes:
    import dns.flags
    import dns.message
    import dns.rcode
    import dns.rdatatype
    import dns.rrset

    query = dns.message.from_wire(wire)
    reply = dns.message.make_response(query)
    reply.flags |= dns.flags.AA
    question = query.question[0]
    name = question.name.to_text().rstrip(".").lower()
    try:
        names = json.loads(Path(spec["names"]).read_text())
    except (OSError, ValueError):
        names = {}
    addrs = names.get(name)
    if addrs is None:
        parent = name.split(".", 1)[1] if "." in name else ""
        addrs = names.get(f"*.{parent}")
    _log(spec["log"], kind="dns", client=client, name=name, type=dns.rdatatype.to_text(question.rdtype),
         found=addrs is not None)
    if addrs is None:
        reply.set_rcode(dns.rcode.NXDOMAIN)
        return reply.to_wire()
    want = {dns.rdatatype.A: ".", dns.rdatatype.AAAA: ":"}.get(question.rdtype)
    picked = [a for a in addrs if want and want in a and (want == ":" or ":" not in a)]
    if picked:
        reply.answer.append(dns.rrset.from_text_list(question.name, 5, "IN", question.rdtype, picked))
    return reply.to_wire()


class _UDP(socketserver.BaseRequestHandler):
    spec: dict[str, Any] = {}

    def handle(self) -> None:
        data, sock = self.request
        sock.sendto(_answer(self.spec, data, self.client_address[0]), self.client_address)


class _TCP(socketserver.BaseRequestHandler):
    spec: dict[str, Any] = {}

    def handle(self) -> None:
        head = self.request.recv(2)
        if len(head) == 2:
            want, data = int.from_bytes(head, "big"), b""
            while len(data) < want and (piece := self.request.recv(want - len(data))):
                data += piece
            out = _answer(self.spec, data, self.client_address[0])
            self.request.sendall(len(out).to_bytes(2, "big") + out)


class _HTTP(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:
        """``HTTPServer.server_bind`` without its ``getfqdn``: a reverse lookup that waits
        out the resolver's timeouts in a namespace with no DNS."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _ThreadingUDP(socketserver.ThreadingMixIn, socketserver.UDPServer):
    daemon_threads = True
    allow_reuse_address = True


class _ThreadingTCP(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _servers(spec: dict[str, Any]) -> list[socketserver.BaseServer]:
    out: list[socketserver.BaseServer] = []
    for role, addrs in (("web", spec["web"]), ("index", [spec["index"]])):
        handler = type(f"_{role}", (_Handler,), {"spec": spec, "role": role})
        for addr in addrs:
            out.append(_HTTP((addr, 80), handler))
    if spec.get("dns"):
        out.append(_ThreadingUDP((spec["dns"], 53), type("_udp", (_UDP,), {"spec": spec})))
        out.append(_ThreadingTCP((spec["dns"], 53), type("_tcp", (_TCP,), {"spec": spec})))
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    print("netns", flush=True)  # in the new namespace now: the parent may move the link in
    if sys.stdin.readline().strip() != "go":
        return
    servers = _servers(spec)
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes the pipe (or dies)
    os._exit(0)  # daemon threads may be mid-write: no clean-up needed, the namespace goes


if __name__ == "__main__":
    main()
