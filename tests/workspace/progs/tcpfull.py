"""A loopback TCP pair with maximum buffers and both directions full, for the fork tests.

    tcpfull.py OUT_DIR EXTRA_BYTES

Two sockets of one connection on 127.0.0.1, each with the largest send and receive
buffers the host allows (SO_SNDBUF/SO_RCVBUF at net.core.wmem_max/rmem_max). Each side
writes a stream of 64-bit big-endian counters without reading until the kernel takes no
more: both send queues and both receive windows are full. Then OUT_DIR/ready holds the
bytes queued each way. Once OUT_DIR/go appears, each side writes EXTRA_BYTES more and
reads everything the other sent, checking every counter (each byte once, in order);
OUT_DIR/result is JSON: ok, bytes read each way, seconds taken, error.
"""

import json
import os
import socket
import struct
import sys
import threading
import time

DEADLINE = 30.0


def put(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)


def stream(off: int, n: int) -> bytes:
    """Bytes [off, off + n) of the stream of 64-bit big-endian counters 0, 1, 2, ..."""
    first, last = off // 8, (off + n + 7) // 8
    data = struct.pack(f">{last - first}Q", *range(first, last))
    return data[off - first * 8: off - first * 8 + n]


def fill(sk: socket.socket) -> int:
    """Write the stream until the kernel takes no more (twice, 50 ms apart); the bytes written."""
    sk.setblocking(False)
    sent, refused = 0, 0
    while refused < 2:
        try:
            sent += sk.send(stream(sent, 1 << 16))
            refused = 0
        except BlockingIOError:
            refused += 1
            time.sleep(0.05)
    return sent


def end_of(start: int, extra: int) -> int:
    return (start + extra + 7) // 8 * 8  # whole counters at the end


def writer(sk: socket.socket, start: int, extra: int, out: dict, key: str) -> None:
    end = end_of(start, extra)
    try:
        sk.sendall(stream(start, end - start))
    except OSError as e:  # a stall: the timeout, said in the result
        out[key + "_write"] = f"{type(e).__name__} after {time.monotonic() - T0[0]:.1f} s"


T0 = [0.0]  # when the run began
READ: dict = {}  # bytes read so far, by direction


def reader(sk: socket.socket, total: int, out: dict, key: str) -> None:
    try:
        read(sk, total, out, key)
    except OSError as e:  # a stall: where it stopped, said in the result
        out[key] = (f"{type(e).__name__} after {time.monotonic() - T0[0]:.1f} s, "
                    f"{READ.get(key, 0)} of {total} bytes read")


def read(sk: socket.socket, total: int, out: dict, key: str) -> None:
    got, expect, rest = 0, 0, b""
    while got < total:
        data = sk.recv(1 << 16)
        if not data:
            out[key] = f"closed after {got} of {total} bytes"
            return
        got += len(data)
        READ[key] = got
        rest += data
        whole = len(rest) // 8 * 8
        for (value,) in struct.iter_unpack(">Q", rest[:whole]):
            if value != expect:
                out[key] = f"counter {value} where {expect} was due"
                return
            expect += 1
        rest = rest[whole:]
    out[key + "_bytes"] = got


def main() -> None:
    out, extra = sys.argv[1], int(sys.argv[2]) // 8 * 8
    lsk = socket.socket()
    lsk.bind(("127.0.0.1", 0))
    lsk.listen(1)
    a = socket.socket()
    for sk in (a, lsk):
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)
        sk.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 30)
    a.connect(lsk.getsockname())
    b, _ = lsk.accept()
    sent_ab, sent_ba = fill(a), fill(b)
    put(os.path.join(out, "ready"), json.dumps({"a_to_b": sent_ab, "b_to_a": sent_ba,
                                                "rcvbuf": b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)}))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.01)
    for sk in (a, b):
        sk.setblocking(True)
        sk.settimeout(DEADLINE)
    res: dict = {}
    t0 = T0[0] = time.monotonic()
    threads = [threading.Thread(target=writer, args=(a, sent_ab, extra, res, "a_to_b")),
               threading.Thread(target=writer, args=(b, sent_ba, extra, res, "b_to_a")),
               threading.Thread(target=reader, args=(b, end_of(sent_ab, extra), res, "a_to_b")),
               threading.Thread(target=reader, args=(a, end_of(sent_ba, extra), res, "b_to_a"))]
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join(DEADLINE + 5)
    errors = [v for k, v in res.items() if not k.endswith("_bytes")]
    res.update(ok=not errors and "a_to_b_bytes" in res and "b_to_a_bytes" in res,
               seconds=round(time.monotonic() - t0, 3))
    put(os.path.join(out, "result"), json.dumps(res))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
