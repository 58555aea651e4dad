"""Integration: ``e2b_code_interpreter.Sandbox`` (the unmodified SDK from PyPI) over real
loopback HTTP against ``bunshin serve``'s code interpreter (port 49999 of a sandbox, by the
``E2b-Sandbox-Port`` header or the host name), on a real workspace and its forks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

e2b_ci = pytest.importorskip("e2b_code_interpreter")
import httpx  # noqa: E402
from e2b import ConnectionConfig, NotFoundException, SandboxException, TimeoutException  # noqa: E402
from packaging.version import Version  # noqa: E402

from bunshin.config import Config  # noqa: E402
from bunshin.server.e2b.auth import envd_access_token, traffic_access_token  # noqa: E402
from bunshin.server.e2b.interpreter.app import STOP_GRACE_S  # noqa: E402
from bunshin.server.e2b.interpreter.contexts import RUNS_DIR  # noqa: E402
from bunshin.server.thread import serve_in_thread  # noqa: E402
from bunshin.workspace import Workspace  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.criu]
TOKEN = "interpreter-test-token-0123456789"


@dataclass
class Rig:
    url: str
    cfg: Config
    sbx: Any  # the module's sandbox, made by Sandbox.create through the control plane

    @property
    def ws(self) -> Workspace:
        return Workspace.get(self.sbx.sandbox_id, config=self.cfg)

    def sandbox(self, sid: str | None = None, *, token: str | None = None, cls=None):
        """An SDK object for sandbox ``sid`` (this one by default) holding ``token`` (its own)."""
        sid = sid or self.sbx.sandbox_id
        kind = cls or e2b_ci.Sandbox
        return kind(sandbox_id=sid, envd_version=Version("0.4.0"), sandbox_domain=None,
                    envd_access_token=envd_access_token(TOKEN, sid) if token is None else token,
                    traffic_access_token=traffic_access_token(TOKEN, sid) if token is None else token,
                    connection_config=ConnectionConfig(sandbox_url=self.url, api_key=TOKEN, request_timeout=30))


@pytest.fixture(scope="module")
def rig(cfg: Config) -> Iterator[Rig]:
    """``bunshin serve`` over loopback and one sandbox of the SDK's default template
    (``code-interpreter-v1``) for the module; every sandbox and template goes after."""
    with serve_in_thread(cfg, TOKEN) as url:
        sbx = e2b_ci.Sandbox.create(envs={"FROM_CREATE": "sandbox", "ONLY_NOW": "create's"},
                                    api_url=url, sandbox_url=url, api_key=TOKEN)
        try:
            yield Rig(url, cfg, sbx)
        finally:
            with httpx.Client(base_url=url, headers={"X-API-Key": TOKEN}, timeout=60) as c:
                for sb in c.get("/v2/sandboxes").json():
                    c.delete(f"/sandboxes/{sb['sandboxID']}")
                for t in c.get("/templates").json():
                    c.delete(f"/templates/{t['templateID']}")
    assert not any(leftovers(cfg).values()), leftovers(cfg)


def test_results_logs_errors_and_state_carry_over(rig: Rig) -> None:
    sbx = rig.sbx
    first = sbx.run_code("import sys\nx = 40\nprint('to out'); print('to err', file=sys.stderr)\nx + 2")
    assert first.text == "42" and first.error is None
    assert first.logs.stdout == ["to out\n"] and first.logs.stderr == ["to err\n"]
    again = sbx.run_code("x += 1\nx")
    assert again.text == "41" and again.execution_count == first.execution_count + 1
    html = sbx.run_code("class T:\n    def _repr_html_(self): return '<i>t</i>'\nT()")
    assert html.results[0].html == "<i>t</i>" and html.results[0].is_main_result
    failed = sbx.run_code("def f():\n    raise KeyError('nope')\nf()")
    assert failed.error.name == "KeyError" and failed.error.value == "'nope'"
    assert "in f" in failed.error.traceback and failed.text is None
    assert sbx.run_code("import os\nos.environ.get('ONLY_NOW')", envs={"ONLY_NOW": "yes"}).text == "'yes'"
    assert sbx.run_code("os.environ.get('ONLY_NOW')").text == '"create\'s"'  # the run's envs win for the run
    assert sbx.run_code("os.environ['FROM_CREATE']").text == "'sandbox'"  # the sandbox's envVars


def test_output_streams_while_the_code_runs(rig: Rig) -> None:
    seen: list[tuple[str, float]] = []
    sbx = rig.sandbox()
    run = sbx.run_code("import time\nprint('early', flush=True)\ntime.sleep(1.5)\nprint('late')",
                       on_stdout=lambda m: seen.append((m.line, time.monotonic())))
    ended = time.monotonic()
    assert [s for s, _ in seen] == ["early\n", "late\n"] and run.logs.stdout == ["early\n", "late\n"]
    assert ended - seen[0][1] > 0.7  # the first line came long before the run ended


def test_other_calls_go_on_while_code_runs(rig: Rig) -> None:
    """A long run holds no lock on the sandbox: envd's commands and files answer meanwhile."""
    sbx = rig.sbx
    runner = threading.Thread(target=sbx.run_code, args=("import time\ntime.sleep(4)",))
    runner.start()
    try:
        time.sleep(0.5)
        started = time.monotonic()
        assert sbx.commands.run("echo meanwhile").stdout == "meanwhile\n"
        assert time.monotonic() - started < 2.5 and runner.is_alive()
    finally:
        runner.join()
    assert rig.ws.exec(["sh", "-c", "ls /run/bunshin-e2b/runs | wc -l"]).stdout.strip() == "0"  # no run's files left


def test_a_fork_taken_while_code_runs_finishes_the_run_in_its_copy(rig: Rig) -> None:
    sbx = rig.sbx
    results: list = []
    runner = threading.Thread(target=lambda: results.append(
        sbx.run_code("import time\ntime.sleep(2)\nmid_run = 'done'\nmid_run")))
    runner.start()
    time.sleep(0.5)
    (fork,) = sbx.fork(count=1)
    runner.join()
    assert results[0].text == "'done'"  # the source's run ended as if nothing happened
    assert fork.run_code("mid_run").text == "'done'"  # the fork's copy of the run ended too
    fork.kill()


def test_contexts_are_separate_interpreters(rig: Rig) -> None:
    sbx = rig.sandbox()
    rig.ws.exec(["mkdir", "-p", "/srv/ctx"])
    ctx = sbx.create_code_context(cwd="/srv/ctx")
    assert ctx.language == "python" and ctx.cwd == "/srv/ctx"
    assert sbx.run_code("import os\nos.getcwd()", context=ctx).text == "'/srv/ctx'"
    sbx.run_code("mine = 'ctx'", context=ctx)
    assert sbx.run_code("mine", context=ctx).text == "'ctx'"
    assert sbx.run_code("mine").error.name == "NameError"  # the default context has its own globals
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    sbx.restart_code_context(ctx)
    assert sbx.run_code("mine", context=ctx).error.name == "NameError"  # a fresh interpreter
    sbx.remove_code_context(ctx.id)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    with pytest.raises(NotFoundException, match="not found"):
        sbx.run_code("1", context=ctx)
    with pytest.raises(NotFoundException):
        sbx.restart_code_context("no-such-context")
    with pytest.raises(SandboxException, match="not a folder"):
        sbx.create_code_context(cwd="/no/such/folder")


def test_other_languages_are_refused_by_name(rig: Rig) -> None:
    sbx = rig.sandbox()
    with pytest.raises(SandboxException, match="language 'javascript' is not supported.*python only"):
        sbx.run_code("1", language="javascript")
    with pytest.raises(SandboxException, match="language 'r' is not supported"):
        sbx.create_code_context(language="r")
    assert sbx.run_code("1 + 1", language="python").text == "2"


def test_tokens_and_sandbox_ids_are_checked(rig: Rig) -> None:
    other = e2b_ci.Sandbox.create(api_url=rig.url, sandbox_url=rig.url, api_key=TOKEN)
    wrong = rig.sandbox(token="0" * 64)
    with pytest.raises(SandboxException, match="401.*access token"):
        wrong.run_code("1")
    with pytest.raises(SandboxException, match="401"):
        wrong.list_code_contexts()
    # the other sandbox's own tokens open it, not this one
    crossed = rig.sandbox(rig.ws.id, token=envd_access_token(TOKEN, other.sandbox_id))
    with pytest.raises(SandboxException, match="401"):
        crossed.run_code("1")
    assert other.run_code("'other'").text == "'other'"
    other.kill()
    with pytest.raises(NotFoundException, match="not found"):
        rig.sandbox("ws-000000000000").run_code("1")


def test_the_host_name_names_the_sandbox_and_port(rig: Rig) -> None:
    """``49999-<sandbox id>.<domain>`` (what ``get_host(49999)`` gives) reaches the same API."""
    rig.sandbox().run_code("1")  # the default context exists from its first run
    host = f"49999-{rig.ws.id}.e2b.localhost"
    ok = httpx.get(f"{rig.url}/contexts", headers={"Host": host,
                   "E2B-Traffic-Access-Token": traffic_access_token(TOKEN, rig.ws.id)})
    assert ok.status_code == 200 and any(c["id"] == "default-python" for c in ok.json())
    assert httpx.get(f"{rig.url}/contexts", headers={"Host": host}).status_code == 401


def test_a_timed_out_run_is_interrupted_and_the_state_stays(rig: Rig) -> None:
    sbx = rig.sandbox()
    sbx.run_code("kept = 'here'")
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\ntime.sleep(60)", timeout=1)
    started = time.monotonic()
    assert sbx.run_code("kept").text == "'here'"
    assert time.monotonic() - started < 15  # the sleep was interrupted, not waited out
    procs = [p.cmdline for p in rig.ws.processes()]
    assert not any("pyrepl.py call" in " ".join(c) for c in procs), procs  # no call left behind
    # nor its files: the server removes them once the interrupted run answers (within STOP_GRACE_S)
    deadline = time.monotonic() + STOP_GRACE_S + 5
    while (left := rig.ws.exec(["ls", RUNS_DIR]).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == [], left


def test_async_client(rig: Rig) -> None:
    async def go() -> tuple[str | None, list[str]]:
        sbx = rig.sandbox(cls=e2b_ci.AsyncSandbox)
        out: list[str] = []
        r = await sbx.run_code("print('async'); 6 * 7", on_stdout=lambda m: out.append(m.line))
        return r.text, out

    assert asyncio.run(go()) == ("42", ["async\n"])


def test_each_fork_continues_the_session_and_diverges_alone(rig: Rig) -> None:
    """``Sandbox.fork`` (live fork) of a sandbox holding a Python session: every fork has the
    session's globals and its own interpreter from then on."""
    sbx = rig.sbx
    sbx.run_code("trail = ['parent']")
    forks = sbx.fork(count=2)
    assert all(isinstance(f, e2b_ci.Sandbox) for f in forks), forks
    for i, f in enumerate(forks):
        f.run_code(f"trail.append('fork{i}')")
    sbx.run_code("trail.append('parent again')")
    assert sbx.run_code("trail").text == "['parent', 'parent again']"
    for i, f in enumerate(forks):
        assert f.run_code("trail").text == f"['parent', 'fork{i}']"
        f.kill()


def test_pause_and_connect_keep_the_session(rig: Rig) -> None:
    """``pause`` (a snapshot; the workspace goes) and ``connect`` (restored under the same id):
    the interpreter comes back with its globals."""
    sbx = e2b_ci.Sandbox.create(api_url=rig.url, sandbox_url=rig.url, api_key=TOKEN)
    sbx.run_code("paused_with = [1, 2, 3]")
    sbx.pause()
    with pytest.raises(NotFoundException):
        sbx.run_code("paused_with")  # the workspace is gone while paused
    back = e2b_ci.Sandbox.connect(sbx.sandbox_id, api_url=rig.url, sandbox_url=rig.url, api_key=TOKEN)
    assert back.run_code("paused_with + [4]").text == "[1, 2, 3, 4]"
    back.kill()
