"""SWE-ReX's own ``RemoteRuntime`` client against ``/swerex/{workspace}`` of a real server on
loopback: sessions, commands, files, uploads, SWE-ReX's failure shapes, and hostile uploads."""

from __future__ import annotations

import asyncio
import io
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime

from bunshin.client import RemoteWorkspace


def _rt(served: Any, ws_id: str, token: str | None = None) -> RemoteRuntime:
    return RemoteRuntime(host=f"{served.url}/swerex/{ws_id}", auth_token=token or served.token, timeout=10)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture
def ws(served) -> Any:
    with served.client() as c:
        w = c.create(memory="1G")
        try:
            yield w
        finally:
            w.remove()


def test_sessions_commands_and_files(served, ws: RemoteWorkspace, tmp_path: Path) -> None:
    rt = _rt(served, ws.id)
    assert run(rt.is_alive()).is_alive
    assert run(rt.create_session(CreateBashSessionRequest())).output == ""
    run(rt.run_in_session(BashAction(command="cd /tmp && export A=41 && touch made-here")))
    obs = run(rt.run_in_session(BashAction(command="echo $((A + 1)) $PWD")))
    assert (obs.output.strip(), obs.exit_code) == ("42 /tmp", 0)
    assert run(rt.run_in_session(BashAction(command="exit_7() { return 7; }; exit_7", check="silent"))).exit_code == 7
    assert run(rt.run_in_session(BashAction(command="false", check="ignore"))).exit_code is None
    assert run(rt.run_in_session(BashInterruptAction())).exit_code == 0  # nothing runs between calls

    r = run(rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 3"])))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = run(rt.execute(Command(command="echo $B; echo e >&2", shell=True, env={"B": "b"}, cwd="/tmp",
                               merge_output_streams=True)))
    assert (r.stdout, r.stderr, r.exit_code) == ("b\ne\n", "", 0)

    run(rt.write_file(WriteFileRequest(path="/work/notes/a.txt", content="héllo\n")))
    assert run(rt.read_file(ReadFileRequest(path="/work/notes/a.txt"))).content == "héllo\n"
    assert ws.files.read("/work/notes/a.txt") == "héllo\n".encode()
    ws.files.write("/work/latin1", b"caf\xe9")
    assert run(rt.read_file(ReadFileRequest(path="/work/latin1", encoding="latin-1"))).content == "café"

    # a file, and a folder (RemoteRuntime zips it) with an executable and a nested file
    (tmp_path / "one.txt").write_text("one")
    tools = tmp_path / "tools"
    (tools / "bin").mkdir(parents=True)
    (tools / "bin" / "hello").write_text("#!/bin/sh\necho hello from tools\n")
    (tools / "bin" / "hello").chmod(0o755)
    (tools / "lib" / "deep").mkdir(parents=True)
    (tools / "lib" / "deep" / "x.py").write_text("X = 1\n")
    run(rt.upload(UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/work/up/one.txt")))
    run(rt.upload(UploadRequest(source_path=str(tools), target_path="/root/tools")))
    assert ws.files.read("/work/up/one.txt") == b"one"
    assert ws.files.read("/root/tools/lib/deep/x.py") == b"X = 1\n"
    assert run(rt.execute(Command(command=["/root/tools/bin/hello"]))).stdout == "hello from tools\n"

    run(rt.close_session(CloseBashSessionRequest()))
    run(rt.create_session(CreateBashSessionRequest(session="other", startup_source=["/root/tools/lib/deep/x.py"])))
    run(rt.close())
    with pytest.raises(SessionDoesNotExistError):
        run(rt.run_in_session(BashAction(command="true", session="other")))
    assert ws.exec("ls /tmp/made-here").ok  # the workspace stays: its owner removes it


def test_session_names_follow_a_fork(served, ws: RemoteWorkspace) -> None:
    rt = _rt(served, ws.id)
    run(rt.create_session(CreateBashSessionRequest()))
    run(rt.run_in_session(BashAction(command="export K=parent; cd /tmp")))
    (clone,) = ws.fork(1)
    try:
        crt = _rt(served, clone.id)
        run(crt.run_in_session(BashAction(command="export K=clone")))
        assert run(crt.run_in_session(BashAction(command="echo $K $PWD"))).output.strip() == "clone /tmp"
        assert run(rt.run_in_session(BashAction(command="echo $K $PWD"))).output.strip() == "parent /tmp"
    finally:
        clone.remove()


def test_failure_shapes(served, ws: RemoteWorkspace) -> None:
    bad = _rt(served, ws.id, token="wrong-token")
    alive = run(bad.is_alive())
    assert not alive.is_alive and "401" in alive.message and "Invalid API Key" in alive.message
    with pytest.raises(aiohttp.ClientResponseError) as e:
        run(bad.execute(Command(command=["true"])))
    assert e.value.status == 401
    assert httpx.post(f"{served.url}/swerex/{ws.id}/execute", json={"command": ["true"]}).status_code == 401

    gone = _rt(served, "ws-000000000000")
    alive = run(gone.is_alive())
    assert not alive.is_alive and "ws-000000000000" in alive.message
    with pytest.raises(SwerexException, match="ws-000000000000") as ge:
        run(gone.execute(Command(command=["true"])))
    assert ge.value.extra_info["code"] == "workspace_not_found"  # type: ignore[attr-defined]

    rt = _rt(served, ws.id)
    with pytest.raises(SessionDoesNotExistError, match="nope"):
        run(rt.run_in_session(BashAction(command="true", session="nope")))
    with pytest.raises(SessionDoesNotExistError):
        run(rt.close_session(CloseBashSessionRequest(session="nope")))
    run(rt.create_session(CreateBashSessionRequest()))
    with pytest.raises(SessionExistsError):
        run(rt.create_session(CreateBashSessionRequest()))

    with pytest.raises(CommandTimeoutError, match="timeout after 1.0 seconds"):
        run(rt.run_in_session(BashAction(command="sleep 30", timeout=1)))
    assert run(rt.run_in_session(BashAction(command="echo still here"))).output.strip() == "still here"
    with pytest.raises(CommandTimeoutError):
        run(rt.execute(Command(command="sleep 30", shell=True, timeout=1)))

    with pytest.raises(NonZeroExitCodeError, match="exit code 3"):
        run(rt.run_in_session(BashAction(command="(exit 3)", error_msg="step failed")))
    with pytest.raises(NonZeroExitCodeError, match="exit code 2"):
        run(rt.execute(Command(command=["sh", "-c", "exit 2"], check=True)))
    with pytest.raises(BashIncorrectSyntaxError) as se:
        run(rt.run_in_session(BashAction(command='echo "unterminated')))
    assert "unexpected EOF" in se.value.extra_info["bash_stderr"]  # type: ignore[attr-defined]
    with pytest.raises(SwerexException, match="out of range") as te:
        run(rt.run_in_session(BashAction(command="true", timeout=-1)))
    assert te.value.extra_info["code"] == "invalid_argument" and te.value.extra_info["hint"]  # type: ignore[attr-defined]
    with pytest.raises(SwerexException, match="interactive"):
        run(rt.run_in_session(BashAction(command="gdb", is_interactive_command=True, expect=["(gdb)"])))

    with pytest.raises(FileNotFoundError):
        run(rt.read_file(ReadFileRequest(path="/no/such/file")))
    ws.files.write("/work/bin", b"\xff\xfe")
    with pytest.raises(ValueError, match="/work/bin"):
        run(rt.read_file(ReadFileRequest(path="/work/bin")))
    with pytest.raises(LookupError):
        run(rt.read_file(ReadFileRequest(path="/work/bin", encoding="no-such-codec")))


def _zip(members: list[tuple[str, bytes, int]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            z.writestr(info, data)
    return buf.getvalue()


def _upload(served: Any, ws_id: str, body: bytes, target: str) -> httpx.Response:
    return httpx.post(f"{served.url}/swerex/{ws_id}/upload", headers={"X-API-Key": served.token},
                      files={"file": ("z.zip", body)}, data={"target_path": target, "unzip": "true"})


def test_hostile_uploads_stay_in_the_workspace(served, ws: RemoteWorkspace, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    # escaping names are refused before anything is written
    for evil in ("../../../.." + str(canary), str(canary), "ok/../../escape"):
        r = _upload(served, ws.id, _zip([("fine.txt", b"fine", 0o644), (evil, b"pwned", 0o644)]), "/work/z")
        assert r.status_code == 511, r.text
        assert r.json()["swerexception"]["class_path"] == "builtins.ValueError"
        assert "refused" in r.json()["swerexception"]["message"]
        assert not ws.exec("test -e /work/z/fine.txt").ok
    # a link member becomes a plain file; setuid bits are dropped
    body = _zip([("link", b"/etc/shadow", stat.S_IFLNK | 0o777), ("suid", b"#!/bin/sh\n", 0o4755)])
    assert _upload(served, ws.id, body, "/work/z").status_code == 200
    assert ws.files.read("/work/z/link") == b"/etc/shadow"
    modes = ws.exec("stat -c '%F %a' /work/z/link /work/z/suid").stdout.splitlines()
    assert modes == ["regular file 777", "regular file 755"]
    # a symlink the workspace planted towards a host path resolves inside the workspace
    assert ws.exec(f"mkdir -p {tmp_path} && ln -s {tmp_path} /work/planted").ok
    assert _upload(served, ws.id, _zip([("canary", b"pwned", 0o644)]), "/work/planted").status_code == 200
    assert canary.read_text() == "untouched"
    assert ws.files.read(f"{tmp_path}/canary") == b"pwned"  # the workspace's own folder of that name
    def chunks():  # no Content-Length: a body of unknown size is not spooled on the host
        yield b"--b\r\nContent-Disposition: form-data; name=\"target_path\"\r\n\r\n/work/c\r\n--b--\r\n"
    r = httpx.post(f"{served.url}/swerex/{ws.id}/upload", content=chunks(),
                   headers={"X-API-Key": served.token, "Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 511 and "Content-Length" in r.json()["swerexception"]["message"]
    r = _upload(served, ws.id, b"not a zip", "/work/z2")
    assert r.status_code == 511 and r.json()["swerexception"]["class_path"] == "zipfile.BadZipFile"
    assert canary.read_text() == "untouched"


def _lies() -> dict[str, bytes]:
    """Zips whose headers lie (CRC, compression method, encryption, offsets, sizes)."""
    good = io.BytesIO()
    with zipfile.ZipFile(good, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("a.txt", b"hello world" * 100)
    raw = good.getvalue()
    cd, eocd = raw.find(b"PK\x01\x02"), raw.find(b"PK\x05\x06")

    def patch(*edits: tuple[int, bytes]) -> bytes:
        b = bytearray(raw)
        for at, value in edits:
            b[at:at + len(value)] = value
        return bytes(b)

    return {
        "crc": patch((14, b"\0" * 4), (cd + 16, b"\0" * 4)),
        "method": patch((8, struct.pack("<H", 99)), (cd + 10, struct.pack("<H", 99))),
        "encrypted": patch((6, bytes([raw[6] | 1])), (cd + 8, bytes([raw[cd + 8] | 1]))),
        "bzip2": patch((8, struct.pack("<H", 12)), (cd + 10, struct.pack("<H", 12))),
        "offset": patch((eocd + 16, struct.pack("<I", 0xFFFFFFF0))),
        "local header": patch((cd + 42, struct.pack("<I", 3))),
        "size": patch((cd + 24, struct.pack("<I", 5000))),
    }


@pytest.mark.parametrize("lie", list(_lies()))
def test_a_lying_zip_is_a_clear_error_and_writes_nothing(served, ws: RemoteWorkspace, lie: str) -> None:
    r = _upload(served, ws.id, _lies()[lie], "/work/lie")
    assert r.status_code == 511, r.text  # SWE-ReX's error shape: its client raises the class below
    err = r.json()["swerexception"]
    assert err["class_path"] in ("zipfile.BadZipFile", "builtins.ValueError"), err
    assert "zip" in err["message"] and "Traceback" not in err["message"], err
    assert not ws.exec("test -e /work/lie/a.txt").ok


def test_remote_deployment_from_its_config(served, ws: RemoteWorkspace) -> None:
    """What SWE-agent's ``deployment: {type: remote, host, auth_token}`` builds."""
    from swerex.deployment.config import RemoteDeploymentConfig

    async def go() -> None:
        d = RemoteDeploymentConfig(host=f"{served.url}/swerex/{ws.id}", auth_token=served.token,
                                   timeout=10).get_deployment()
        await d.start()
        assert (await d.is_alive()).is_alive
        await d.runtime.create_session(CreateBashSessionRequest())
        obs = await d.runtime.run_in_session(BashAction(command="echo deployed > /tmp/d && cat /tmp/d"))
        assert obs.output.strip() == "deployed"
        await d.stop()  # closes the runtime: its sessions, not the workspace

    run(go())
    assert ws.files.read("/tmp/d") == b"deployed\n"
