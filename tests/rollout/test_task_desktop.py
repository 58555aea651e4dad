"""Task specs with a desktop (``desktop: true``), and a task root that has one."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from bunshin.errors import InvalidArgument
from bunshin.rollout.envs import SnapshotEnv
from bunshin.rollout.task import parse_task
from bunshin.runtime.state.records import SnapshotMode
from bunshin.tools import ToolSet
from bunshin.workspace.desktop import DesktopSpec


def test_desktop_field_forms():
    assert parse_task({"id": "a"}).desktop is None
    assert parse_task({"id": "a", "desktop": True}).desktop == DesktopSpec().to_dict()
    assert parse_task({"id": "a", "desktop": "800x600"}).desktop == DesktopSpec(width=800, height=600).to_dict()
    t = parse_task({"id": "a", "desktop": {"width": 1024, "height": 768, "window_manager": "none"}})
    assert DesktopSpec.from_dict(t.desktop or {}).window_manager == "none"


def test_desktop_changes_the_root_key_and_only_then():
    plain, desk = parse_task({"id": "a"}), parse_task({"id": "a", "desktop": True})
    assert plain.root_key("host") != desk.root_key("host")
    assert parse_task({"id": "a", "desktop": False}).root_key("host") == plain.root_key("host")
    assert desk.root_key("host") != parse_task({"id": "a", "desktop": "800x600"}).root_key("host")


@pytest.mark.parametrize("bad", ["huge", {"depth": 8}, {"width": 1280, "wm": "x"}, 7])
def test_bad_desktop_names_the_field(bad):
    with pytest.raises(InvalidArgument) as e:
        parse_task({"id": "a", "desktop": bad})
    assert "field 'desktop'" in e.value.message


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("Xvfb") is None or shutil.which("jwm") is None,
                    reason="needs xvfb, xdotool and jwm: run `make install`")
def test_task_root_has_its_desktop_and_setup_ran_on_it(no_leaks):
    task = parse_task({"id": "desk", "desktop": "400x300", "memory": "1G",
                       "setup": [{"run": "DISPLAY=:0 xterm -geometry 30x5+0+0", "background": True},
                                 "for i in $(seq 100); do DISPLAY=:0 xdotool search --name xterm && exit; "
                                 "sleep 0.1; done; exit 1"]})

    async def run():
        env = SnapshotEnv(task, ToolSet.default(), no_leaks, snapshot_mode=SnapshotMode.COW)
        await env.prepare()
        try:
            traj = await env.open(0)
            try:  # the clone of the root: its desktop and the xterm setup opened are there
                dims = await traj.call("bash", {"command": "DISPLAY=:0 xdpyinfo | grep dimensions"})
                win = await traj.call("bash", {"command": "DISPLAY=:0 xdotool search --name xterm getwindowname"})
                return dims.output, win.output
            finally:
                await traj.close()
        finally:
            await env.aclose()

    dims, windows = asyncio.run(run())
    assert "400x300 pixels" in dims and windows.strip() == "xterm"


def test_a_desktop_task_has_the_desktop_tools_in_the_default_set():
    from bunshin.rollout.envs import scope_tools, with_task_tools

    plain, desk = parse_task({"id": "a"}), parse_task({"id": "a", "desktop": True, "tools": ["bash", "screenshot"]})
    default = ToolSet.default()
    assert "screenshot" not in with_task_tools(default, plain)
    assert [t.name for t in scope_tools(default, desk)] == ["bash", "screenshot"]  # type: ignore[union-attr]


@pytest.mark.integration
@pytest.mark.criu
@pytest.mark.skipif(shutil.which("Xvfb") is None or shutil.which("jwm") is None,
                    reason="needs xvfb, xdotool and jwm: run `make install`")
def test_engine_runs_a_desktop_task_with_its_default_tools_and_sends_the_screenshot_as_an_image(no_leaks):
    from bunshin.rollout import RolloutEngine, TraceReplayPolicy, parse_traces

    task = parse_task({"id": "desk-engine", "desktop": "320x240", "memory": "1G", "tools": ["screenshot", "bash"],
                       "reward": "echo 1"})
    traces = parse_traces(['{"id": "t", "task": "desk-engine", "steps": [{"name": "screenshot", "arguments": {}}]}'])

    async def run():
        async with RolloutEngine("bunshin", config=no_leaks) as engine:
            return await engine.run_group(task, TraceReplayPolicy(traces), 1)

    (traj,) = asyncio.run(run()).trajectories
    assert traj.reward == 1.0 and traj.error is None
    (msg,) = [m for m in traj.messages if m["role"] == "tool"]
    assert msg["content"][0] == {"type": "text", "text": "screenshot 320x240"}
    assert msg["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
