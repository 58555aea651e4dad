"""envd on ``bunshin serve``, through the unmodified ``e2b`` SDK (sync) over loopback HTTP:
commands, PTYs, files, watches, a sandbox's port, the access token, and the file URLs the SDK signs."""

from __future__ import annotations

import json
import struct
import threading
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import (  # noqa: E402
    AuthenticationException,
    CommandExitException,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxNotRunningException,
    TimeoutException,
)
from e2b.sandbox.signature import get_signature  # noqa: E402

from bunshin.server.e2b.auth import envd_access_token  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import TOKEN, Env, served  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(cfg) -> Env:
    with served(cfg) as e:
        yield e
    assert leftovers(cfg) == {}


@pytest.fixture(scope="module")
def sbx(env: Env) -> Sandbox:
    return env.sandbox(Sandbox)


def test_run_output_exit_code_cwd_envs(sbx: Sandbox) -> None:
    r = sbx.commands.run("echo out; echo err >&2; pwd; echo $GREETING", cwd="/tmp", envs={"GREETING": "hi there"})
    assert (r.exit_code, r.stdout, r.stderr) == (0, "out\n/tmp\nhi there\n", "err\n")
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; exit 3")
    assert (e.value.exit_code, e.value.stdout) == (3, "partial\n")


def test_run_as_user_and_a_user_that_is_not_there(sbx: Sandbox) -> None:
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    sbx.commands.run("id e2buser >/dev/null 2>&1 || useradd -m e2buser")
    r = sbx.commands.run("id -un; echo $HOME; pwd", user="e2buser", cwd="/tmp")
    assert r.stdout == "e2buser\n/home/e2buser\n/tmp\n"
    with pytest.raises(InvalidArgumentException, match="does not exist"):
        sbx.commands.run("true", user="nosuchuser")
    sbx.files.write("mine.txt", "x", user="e2buser")  # relative: that user's home, and theirs
    sbx.files.make_dir("/tmp/theirs", user="e2buser")
    owners = sbx.commands.run("stat -c %U /home/e2buser/mine.txt /tmp/theirs").stdout
    assert owners == "e2buser\ne2buser\n"


def test_timeout_kills_the_command(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo never", timeout=1)
    deadline = time.monotonic() + 10
    while any(p.cmd == "/bin/bash" and "sleep 30" in " ".join(p.args) for p in sbx.commands.list()):
        assert time.monotonic() < deadline, "the timed-out command is still listed"
        time.sleep(0.1)


def test_background_callbacks_list_connect_stdin_kill(sbx: Sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    h = sbx.commands.run("echo ready; echo warn >&2; while read line; do echo got:$line; done",
                         background=True, stdin=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert h.pid in listed and listed[h.pid].cmd == "/bin/bash"
    sbx.commands.send_stdin(h.pid, "one\n")
    h2 = sbx.commands.connect(h.pid)  # a second follower of the same process
    sbx.commands.send_stdin(h.pid, b"two\n")
    seen = ""
    for stdout, _, _ in h2:
        seen += stdout or ""
        if "got:two" in seen:
            break
    h2.disconnect()
    sbx.commands.close_stdin(h.pid)  # EOF: the loop ends, the command exits 0
    result = h.wait(on_stdout=out.append, on_stderr=err.append)
    assert result.exit_code == 0
    assert "".join(out) == "ready\ngot:one\ngot:two\n" and "".join(err) == "warn\n"
    assert h.pid not in {p.pid for p in sbx.commands.list()}

    h3 = sbx.commands.run("sleep 60", background=True)
    assert sbx.commands.kill(h3.pid) is True
    with pytest.raises(CommandExitException):
        h3.wait()
    assert sbx.commands.kill(h3.pid) is False  # gone: the SDK's not-found answer


def test_pty_create_input_resize_kill(sbx: Sandbox) -> None:
    screen = bytearray()
    marks = {b"A:24 80": threading.Event(), b"B:50 132": threading.Event()}

    def on_data(data: bytes) -> None:
        screen.extend(data)
        for mark, seen in marks.items():
            if mark in screen:
                seen.set()

    term = sbx.pty.create(PtySize(rows=24, cols=80), cwd="/tmp")
    reader = threading.Thread(target=_drain, args=(term, on_data), daemon=True)
    reader.start()
    sbx.pty.send_stdin(term.pid, b"tty; echo A:$(stty size)\n")
    assert marks[b"A:24 80"].wait(20), bytes(screen)
    sbx.pty.resize(term.pid, PtySize(rows=50, cols=132))
    sbx.pty.send_stdin(term.pid, b"echo B:$(stty size)\n")
    assert marks[b"B:50 132"].wait(20), bytes(screen)
    assert b"/dev/pts/" in screen
    assert sbx.pty.kill(term.pid) is True
    reader.join(20)
    assert not reader.is_alive()


def _drain(handle, on_data) -> None:  # noqa: ANN001
    try:
        handle.wait(on_pty=on_data)
    except CommandExitException:
        pass  # killed


def test_files_text_bytes_many_list_info_dirs_rename_remove(sbx: Sandbox) -> None:
    info = sbx.files.write("/work/a.txt", "héllo")
    assert (info.path, info.name) == ("/work/a.txt", "a.txt")
    assert sbx.files.read("/work/a.txt") == "héllo"
    blob = bytes(range(256)) * 1000
    sbx.files.write("/work/b.bin", blob)
    assert bytes(sbx.files.read("/work/b.bin", format="bytes")) == blob
    written = sbx.files.write_files([{"path": "/work/d/x.txt", "data": "x"}, {"path": "/work/d/e/y.txt", "data": b"yy"}])
    assert sorted(w.path for w in written) == ["/work/d/e/y.txt", "/work/d/x.txt"]
    assert {e.path for e in sbx.files.list("/work/d")} == {"/work/d/x.txt", "/work/d/e"}
    assert {e.path for e in sbx.files.list("/work/d", depth=2)} == {"/work/d/x.txt", "/work/d/e", "/work/d/e/y.txt"}
    st = sbx.files.get_info("/work/b.bin")
    assert (st.type, st.size, st.permissions) == (FileType.FILE, len(blob), "-rw-r--r--")
    assert sbx.files.exists("/work/a.txt") and not sbx.files.exists("/work/none")
    assert sbx.files.make_dir("/work/new/deep") is True
    assert sbx.files.make_dir("/work/new/deep") is False  # already there
    moved = sbx.files.rename("/work/a.txt", "/work/new/a.txt")
    assert moved.path == "/work/new/a.txt" and sbx.files.read("/work/new/a.txt") == "héllo"
    sbx.files.remove("/work/new")
    assert not sbx.files.exists("/work/new/a.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/work/new/a.txt")
    sbx.files.write("rel.txt", "home")  # relative: the user's home
    assert sbx.commands.run("cat /root/rel.txt").stdout == "home"


def test_watch_dir(sbx: Sandbox) -> None:
    sbx.files.make_dir("/watched")
    w = sbx.files.watch_dir("/watched", recursive=True)
    try:
        sbx.files.write("/watched/f.txt", "1")
        sbx.commands.run("mkdir -p /watched/sub && echo 2 > /watched/sub/g.txt && echo more >> /watched/f.txt")
        seen: set[tuple[str, str]] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {("f.txt", "create"), ("sub/g.txt", "create")} <= seen:
            seen |= {(e.name, e.type.value) for e in w.get_new_events()}
            time.sleep(0.15)
        sbx.files.remove("/watched/f.txt")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and ("f.txt", "remove") not in seen:
            seen |= {(e.name, e.type.value) for e in w.get_new_events()}
            time.sleep(0.15)
    finally:
        w.stop()
    assert {("f.txt", "create"), ("sub/g.txt", "create"), ("f.txt", "remove")} <= seen


def test_a_port_inside_through_the_server(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/srv/index.html", "served from inside")
    server = sbx.commands.run("cd /srv && exec python3 -m http.server 8123 --bind 127.0.0.1", background=True)
    headers = {"E2b-Sandbox-Id": env.ws.id, "E2b-Sandbox-Port": "8123", "X-Access-Token": env.access_token}
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(f"{env.url}/index.html", headers=headers)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert r.text == "served from inside"
    assert httpx.get(f"{env.url}/index.html", headers={**headers, "X-Access-Token": "wrong"}).status_code == 401
    closed = httpx.get(f"{env.url}/", headers={**headers, "E2b-Sandbox-Port": "8124"})
    assert closed.status_code == 502 and "port 8124 is not open" in closed.json()["message"]
    server.kill()
    server.disconnect()


def test_wrong_token_and_another_sandboxs_token(env: Env) -> None:
    for token in ("not-the-token", envd_access_token(TOKEN, "ws-000000000000"), envd_access_token("other", env.ws.id)):
        bad = env.sandbox(Sandbox, token=token)
        with pytest.raises(AuthenticationException):
            bad.commands.run("echo no")
        with pytest.raises(AuthenticationException):
            bad.files.read("/etc/hostname")


def test_a_sandbox_that_is_not_there(env: Env) -> None:
    gone = "ws-0123456789ab"
    sbx = env.sandbox(Sandbox, sandbox_id=gone, token=envd_access_token(TOKEN, gone))
    with pytest.raises(SandboxNotRunningException, match="was not found"):
        sbx.commands.run("echo no")
    with pytest.raises(SandboxNotRunningException):
        sbx.files.write("/x", "no")
    assert sbx.is_running() is False  # envd's /health: 502 for it
    assert env.sandbox(Sandbox).is_running() is True


def test_raw_connect_codecs_and_unimplemented(env: Env) -> None:
    h = {"E2b-Sandbox-Id": env.ws.id, "X-Access-Token": env.access_token}
    j = httpx.post(f"{env.url}/filesystem.Filesystem/Stat", json={"path": "/etc"},
                   headers={**h, "Content-Type": "application/json"})
    assert j.status_code == 200 and j.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    from bunshin.server.e2b.envd.gen.filesystem import filesystem_pb2 as fpb

    b = httpx.post(f"{env.url}/filesystem.Filesystem/Stat", content=fpb.StatRequest(path="/etc").SerializeToString(),
                   headers={**h, "Content-Type": "application/proto"})
    assert b.status_code == 200 and fpb.StatResponse.FromString(b.content).entry.path == "/etc"
    # a server stream in Connect's JSON envelope: a command started with a tag, then signalled by it
    start = json.dumps({"process": {"cmd": "/bin/sleep", "args": ["30"]}, "tag": "sleeper"}).encode()
    with httpx.stream("POST", f"{env.url}/process.Process/Start", content=struct.pack(">BI", 0, len(start)) + start,
                      headers={**h, "Content-Type": "application/connect+json"}) as stream:
        head = b""
        for piece in stream.iter_bytes():
            head += piece
            if len(head) >= 5 and len(head) >= 5 + struct.unpack(">I", head[1:5])[0]:
                break
        first = json.loads(head[5:5 + struct.unpack(">I", head[1:5])[0]])
        pid = first["event"]["start"]["pid"]
        listed = httpx.post(f"{env.url}/process.Process/List", json={}, headers={**h, "Content-Type": "application/json"})
        assert {"pid": pid, "tag": "sleeper"}.items() <= next(
            p for p in listed.json()["processes"] if p["pid"] == pid).items()
        for tag, status in (("nobody", 404), ("sleeper", 200)):
            r = httpx.post(f"{env.url}/process.Process/SendSignal", json={"process": {"tag": tag}, "signal": 9},
                           headers={**h, "Content-Type": "application/json"})
            assert r.status_code == status, r.text
    nope = httpx.post(f"{env.url}/process.Process/Nope", json={}, headers={**h, "Content-Type": "application/json"})
    assert nope.status_code == 404
    for sid, port, status in (("../../etc", "49983", 502), (env.ws.id.upper(), "49983", 502),
                              (env.ws.id, "99999", 400), (env.ws.id, "x", 400)):
        r = httpx.get(f"{env.url}/health", headers={**h, "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": port})
        assert r.status_code == status, (sid, port, r.text)
    assert httpx.get(f"{env.url}/health", headers=h).status_code == 204  # envd's own health


def test_a_client_that_hangs_up_leaves_no_stream_running(env: Env, sbx: Sandbox) -> None:
    from bunshin.server.e2b.envd.rpc import FOLLOWING

    for _ in range(3):
        h = sbx.commands.run("sleep 30", background=True)
        _until(lambda: FOLLOWING.count == 1)
        h.disconnect()  # the command goes on; its follower on the server ends
        _until(lambda: FOLLOWING.count == 0)
        assert h.pid in {p.pid for p in sbx.commands.list()}
        sbx.commands.kill(h.pid)


def _until(cond, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def _read_until(handle, text: str) -> str:  # noqa: ANN001
    seen = ""
    for stdout, _, _ in handle:
        seen += stdout or ""
        if text in seen:
            return seen
    raise AssertionError(f"{text!r} never came; saw {seen!r}")


def test_fork_carries_a_running_command_each_fork_alone(env: Env) -> None:
    opts = {"api_url": env.url, "sandbox_url": env.url, "api_key": TOKEN}
    src = Sandbox.create(timeout=300, **opts)
    forks: list = []
    try:
        src.files.write("/tmp/who", "src")
        h = src.commands.run("while read l; do echo $l:$(cat /tmp/who); done", background=True, stdin=True)
        src.commands.send_stdin(h.pid, "a\n")
        _read_until(h, "a:src")
        h.disconnect()
        forks = src.fork(count=2)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        for i, f in enumerate(forks):
            f.files.write("/tmp/who", f"fork{i}")
        for i, f in enumerate(forks):  # the command runs on in each fork, reading its own stdin
            assert h.pid in {p.pid for p in f.commands.list()}
            c = f.commands.connect(h.pid)
            f.commands.send_stdin(h.pid, "b\n")
            assert _read_until(c, f"b:fork{i}") == f"b:fork{i}\n"
            f.commands.close_stdin(h.pid)
            assert c.wait().exit_code == 0
        c = src.commands.connect(h.pid)  # and in the source, untouched by its forks
        src.commands.send_stdin(h.pid, "c\n")
        assert _read_until(c, "c:src") == "c:src\n"
        src.commands.kill(h.pid)
    finally:
        for s in [src, *[f for f in forks if isinstance(f, Sandbox)]]:
            s.kill()


def test_a_multipart_upload_is_bounded_whole(sbx: Sandbox, monkeypatch) -> None:  # noqa: ANN001
    from bunshin.server.e2b.envd import files

    monkeypatch.setattr(files, "MAX_MULTIPART", 1000)  # the server runs in this process
    with pytest.raises(InvalidArgumentException, match="over the 1000 bytes one upload takes"):
        sbx.files.write_files([{"path": "/up/one", "data": b"1" * 800}, {"path": "/up/two", "data": b"2" * 800}])
    assert not sbx.files.exists("/up/one") and not sbx.files.exists("/up/two")  # nothing half-written
    sbx.files.write_files([{"path": "/up/one", "data": b"1" * 100}, {"path": "/up/two", "data": b"2" * 100}])
    assert sbx.files.read("/up/two") == "2" * 100


def test_bounds_and_another_sandboxs_watcher(env: Env) -> None:
    h = {"E2b-Sandbox-Id": env.ws.id, "X-Access-Token": env.access_token, "Content-Type": "application/json"}

    def rpc(path: str, body: dict, headers: dict = h) -> httpx.Response:
        return httpx.post(f"{env.url}/{path}", json=body, headers=headers, timeout=30)

    for path, body in (("filesystem.Filesystem/Stat", {"path": "/x" * 3000}),
                       ("filesystem.Filesystem/ListDir", {"path": "/", "depth": 1000}),
                       ("filesystem.Filesystem/Stat", {"path": "a\u0000b"})):
        r = rpc(path, body)
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument"), r.text
    r = httpx.post(f"{env.url}/process.Process/SendInput", headers=h, timeout=30,
                   content=b'{"process":{"pid":1},"input":{"stdin":"' + b"A" * (6 << 20) + b'"}}')
    assert r.json()["code"] == "resource_exhausted"  # over the message bound, refused before it is held
    assert rpc("process.Process/SendSignal", {"process": {"pid": 1}, "signal": "SIGNAL_SIGKILL"}).json()["code"] \
        == "not_found"  # only processes envd started: not the agent (pid 1)

    other = Sandbox.create(api_url=env.url, sandbox_url=env.url, api_key=TOKEN, timeout=120)
    try:
        made = rpc("filesystem.Filesystem/CreateWatcher", {"path": "/tmp"})
        wid = made.json()["watcherId"]
        theirs = {**h, "E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": envd_access_token(TOKEN, other.sandbox_id)}
        stolen = rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid}, theirs)
        assert (stolen.status_code, stolen.json()["code"]) == (404, "not_found")
        assert rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid}).status_code == 200
        assert rpc("filesystem.Filesystem/RemoveWatcher", {"watcherId": wid}).status_code == 200
        assert rpc("filesystem.Filesystem/GetWatcherEvents", {"watcherId": wid}).status_code == 404
    finally:
        other.kill()


def test_an_rpc_bunshin_does_not_serve_is_refused_by_name() -> None:
    import asyncio

    from bunshin.server.e2b.envd import ENVD_VERSION
    from bunshin.server.e2b.envd.gen.process import process_pb2
    from bunshin.server.e2b.envd.rpc import service_app

    app = service_app(process_pb2.DESCRIPTOR.services_by_name["Process"], unary={}, streams={})

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://envd") as c:
            return await c.post("/process.Process/List", json={}, headers={"Content-Type": "application/json"})

    r = asyncio.run(call())
    assert (r.status_code, r.json()["code"]) == (501, "unimplemented")
    assert r.json()["message"] == f"process.Process/List is not implemented by bunshin's envd (it serves envd {ENVD_VERSION})"


# --- the file URLs the SDK signs (download_url / upload_url): /files without the token, for their one
# path, operation and user, until their expiration; a signature of another sandbox's token opens nothing


def _signed_get(env: Env, url: str) -> httpx.Response:
    return httpx.get(url, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30)


def _with(url: str, **changes: str) -> str:
    """``url`` with query parameters replaced."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True)) | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_a_signed_download_url_reads_its_file_without_the_token(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/signed.txt", "signed content")
    r = _signed_get(env, sbx.download_url("/tmp/signed.txt"))
    assert (r.status_code, r.text) == (200, "signed content")
    r = _signed_get(env, sbx.download_url("/tmp/signed.txt", use_signature_expiration=60))
    assert (r.status_code, r.text) == (200, "signed content")


def test_a_signed_url_opens_nothing_else(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/other.txt", "not for this URL")
    url = sbx.download_url("/tmp/signed-only.txt")
    refused = {
        "another path": _with(url, path="/tmp/other.txt"),
        "another user": _with(url, username="root"),
        "a changed signature": _with(url, signature="v1_" + "A" * 43),
        "an expiration added": _with(url, signature_expiration="9999999999"),
        "another route": url.replace("/files?", "/envs?"),
    }
    for what, bad in refused.items():
        r = _signed_get(env, bad)
        assert r.status_code == 401, (what, r.status_code, r.text)
        assert "other.txt" not in r.text
    # the token of another sandbox signs nothing here
    other = get_signature("/tmp/other.txt", "read", "user", envd_access_token(TOKEN, "ws-0123456789ab"))
    r = _signed_get(env, _with(url, path="/tmp/other.txt", signature=other["signature"]))
    assert r.status_code == 401


def test_an_expired_signature_is_refused_by_name(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/expiring.txt", "x")
    url = sbx.download_url("/tmp/expiring.txt", use_signature_expiration=60)
    user = dict(parse_qsl(urlsplit(url).query)).get("username")
    gone = get_signature("/tmp/expiring.txt", "read", user, env.access_token, expiration_in_seconds=-5)
    r = _signed_get(env, _with(url, signature=gone["signature"], signature_expiration=str(gone["expiration"])))
    assert r.status_code == 401 and "expired" in r.json()["message"]
    r = _signed_get(env, _with(url, signature_expiration="soon"))
    assert r.status_code == 401 and "Unix time" in r.json()["message"]


def test_a_signed_upload_url_writes_its_one_path(env: Env, sbx: Sandbox) -> None:
    url = sbx.upload_url("/tmp/uploaded.txt")
    # a browser's form names the part after the user's file: the URL's path is what is written
    r = httpx.post(url, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30,
                   files={"file": ("report.txt", b"from a form", "text/plain")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/uploaded.txt") == "from a form"
    assert not sbx.files.exists("report.txt")
    # a read URL does not write, a write URL does not read
    read = sbx.download_url("/tmp/uploaded.txt")
    r = httpx.post(read, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30, files={"file": ("x", b"overwrite")})
    assert r.status_code == 401
    assert _signed_get(env, url).status_code == 401
    assert sbx.files.read("/tmp/uploaded.txt") == "from a form"
