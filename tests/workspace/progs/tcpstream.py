"""A loopback TCP stream with data in flight, for the fork tests.

    tcpstream.py TOTAL_BYTES OUT_DIR

A server and a client (two processes) on 127.0.0.1. The client writes the
stream of 64-bit big-endian counters 0, 1, 2, ... (TOTAL_BYTES of it) as fast
as it can, then closes; the server reads 16 KiB every 5 ms, checks that every
counter is the next one (each byte once, in order) and keeps a running sha256.
Its send queue and the server's receive queue stay full meanwhile. Files in
OUT_DIR: ``ready`` (the stream runs), ``progress`` (bytes read so far),
``result`` (JSON: bytes, sha256, ok, error) when the client has closed or the server's
socket failed; ``error-client`` if the client's did.
"""

import hashlib
import json
import os
import socket
import struct
import sys
import time

CHUNK, PAUSE = 16 << 10, 0.005


def put(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def client(port: int, total: int) -> None:
    sk = socket.create_connection(("127.0.0.1", port))
    sent, counter = 0, 0
    while sent < total:
        n = min(8192, (total - sent) // 8)
        block = struct.pack(f">{n}Q", *range(counter, counter + n))
        sk.sendall(block)
        sent, counter = sent + len(block), counter + n
    sk.close()


def server(lsk: socket.socket, total: int, out: str) -> None:
    conn, _ = lsk.accept()
    digest, got, expect, rest, error = hashlib.sha256(), 0, 0, b"", None
    put(os.path.join(out, "ready"), "1")
    last = time.monotonic()
    while True:
        data = conn.recv(CHUNK)
        if not data:
            break
        digest.update(data)
        got += len(data)
        rest += data
        whole = len(rest) // 8 * 8
        for (value,) in struct.iter_unpack(">Q", rest[:whole]):
            if value != expect and error is None:
                error = f"counter {value} where {expect} was due (byte {expect * 8})"
            expect += 1
        rest = rest[whole:]
        if time.monotonic() - last > 0.05:
            put(os.path.join(out, "progress"), str(got))
            last = time.monotonic()
        time.sleep(PAUSE)
    ok = error is None and got == total and not rest
    put(os.path.join(out, "result"), json.dumps(
        {"bytes": got, "sha256": digest.hexdigest(), "ok": ok, "error": error}))


def main() -> None:
    total, out = int(sys.argv[1]) // 8 * 8, sys.argv[2]
    lsk = socket.socket()
    lsk.bind(("127.0.0.1", 0))
    lsk.listen(1)
    port = lsk.getsockname()[1]
    if os.fork() == 0:
        lsk.close()
        try:
            client(port, total)
        except OSError as e:  # said in OUT_DIR/error-client (a reset, a broken pipe)
            put(os.path.join(out, "error-client"), f"{e!r} at {time.monotonic():.3f}")
            os._exit(1)
        os._exit(0)
    try:
        server(lsk, total, out)
    except OSError as e:  # the result says so
        put(os.path.join(out, "result"), json.dumps(
            {"ok": False, "error": f"server: {e!r} at {time.monotonic():.3f}"}))
    os.wait()


if __name__ == "__main__":
    main()
