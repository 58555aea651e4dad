"""SWE-ReX's own RemoteRuntime on bunshin workspaces, with the group fork (as root:
`python examples/swerex/run.py [--url http://127.0.0.1:8770]`, token in BUNSHIN_TOKEN).

A root workspace is prepared once through SWE-ReX (a session, a venv-like slow step, an
uploaded folder), then forked 3 ways through bunshin's API; each clone is driven by its
own ``RemoteRuntime`` at ``{url}/swerex/{clone}``: same session name, same shell state
(cwd, variables) inherited from the root, changes private to each clone. Without
``--url`` a server runs in this process on a loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile
from contextlib import ExitStack
from pathlib import Path

from swerex.runtime.abstract import BashAction, CreateBashSessionRequest, UploadRequest
from swerex.runtime.remote import RemoteRuntime

from bunshin.client import Client
from bunshin.config import Config
from bunshin.server.thread import serve_in_thread


def runtime(url: str, ws_id: str, token: str) -> RemoteRuntime:
    return RemoteRuntime(host=f"{url}/swerex/{ws_id}", auth_token=token, timeout=10)


async def prepare(rt: RemoteRuntime, tools: Path) -> None:
    await rt.create_session(CreateBashSessionRequest())
    await rt.upload(UploadRequest(source_path=str(tools), target_path="/root/tools"))
    for cmd in ["mkdir -p /work && cd /work", "sleep 2 && echo ready > deps.log", "export PATH=/root/tools:$PATH"]:
        await rt.run_in_session(BashAction(command=cmd, timeout=60))


async def attempt(rt: RemoteRuntime, i: int) -> str:
    await rt.run_in_session(BashAction(command=f"echo attempt-{i} > mine.txt", timeout=10))
    obs = await rt.run_in_session(BashAction(command="pwd; cat deps.log mine.txt; greet", timeout=10))
    return obs.output.strip().replace("\n", " | ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a bunshin serve host (token in BUNSHIN_TOKEN)")
    args = ap.parse_args()
    with ExitStack() as stack:
        if args.url:
            url, token = args.url, os.environ["BUNSHIN_TOKEN"]
        else:
            token = secrets.token_hex(16)
            url = stack.enter_context(serve_in_thread(Config.from_env(), token))
        tools = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        (tools / "greet").write_text("#!/bin/sh\necho hello from an uploaded tool\n")
        (tools / "greet").chmod(0o755)
        client = stack.enter_context(Client(url, token=token))
        root = client.create(memory="512M")
        stack.callback(root.remove)
        asyncio.run(prepare(runtime(url, root.id, token), tools))
        clones = root.fork(3)
        for c in clones:
            stack.callback(c.remove)

        async def drive() -> list[str]:
            return await asyncio.gather(*(attempt(runtime(url, c.id, token), i) for i, c in enumerate(clones)))

        for c, line in zip(clones, asyncio.run(drive()), strict=True):
            print(c.id, "->", line)


if __name__ == "__main__":
    main()
