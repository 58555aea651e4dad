"""A bounded soak over real HTTP: concurrent clients exec, fork, call tools and write files
for a fixed time; no call fails and nothing is left behind (the fixture checks)."""

from __future__ import annotations

import threading
import time

import pytest

from bunshin import ToolSet

pytestmark = [pytest.mark.integration, pytest.mark.criu]

CLIENTS = 4
SECONDS = 6.0


def test_concurrent_clients_for_a_fixed_time(served):
    tools = ToolSet.default(workdir="/tmp")
    failures: list[str] = []
    done = [0] * CLIENTS
    stop = time.monotonic() + SECONDS

    def client(i: int) -> None:
        with served.client() as c:
            ws = c.create(memory="512M")
            try:
                n = 0
                while time.monotonic() < stop:
                    n += 1
                    data = f"{i}-{n}\n".encode() * 100
                    ws.files.write(f"/tmp/f{n % 3}", data)
                    assert ws.files.read(f"/tmp/f{n % 3}") == data
                    assert ws.exec(["cat", f"/tmp/f{n % 3}"], timeout=30).stdout.encode() == data
                    obs = tools.run_sync(ws, "bash", {"command": f"export N={n}; echo $N"})
                    assert obs.output == f"{n}\n", obs
                    if n % 4 == 0:
                        (clone,) = ws.fork(1)
                        assert clone.exec("echo $((1+1))", timeout=30).stdout == "2\n"
                        clone.remove()
                    done[i] += 1
            except Exception as exc:
                failures.append(f"client {i}: {exc!r}")
            finally:
                ws.remove()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS + 120)
    assert not any(t.is_alive() for t in threads), "the soak did not stop by itself"
    assert failures == []
    assert all(n >= 2 for n in done), done
