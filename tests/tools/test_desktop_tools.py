"""The desktop tools: image observations, tool errors, and the prefix cache over a real desktop."""

from __future__ import annotations

import asyncio
import base64
import io
import shutil

import pytest
from PIL import Image

from bunshin.cache import CachePolicy, PrefixCache
from bunshin.tools import Observation, ToolSet
from bunshin.workspace import Workspace

needs_x = pytest.mark.skipif(shutil.which("Xvfb") is None or shutil.which("jwm") is None,
                             reason="needs xvfb, x11-apps, xdotool and jwm: run `make install`")


def _png(obs: Observation) -> Image.Image:
    (b64,) = obs.images
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_image_observation_in_openai_format_and_round_trip():
    obs = Observation("screenshot 2x2", 0, images=("iVBORw0KGgo=",))
    assert obs.content() == [{"type": "text", "text": "screenshot 2x2"},
                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    assert Observation.from_dict(obs.to_dict()) == obs
    assert not obs.same_result(Observation("screenshot 2x2", 0, images=("AAAA",)))
    plain = Observation("hi", 0)
    assert plain.content() == "hi" and "images" not in plain.to_dict()


def test_desktop_tool_set_schemas():
    ts = ToolSet.desktop()
    names = [t.name for t in ts]
    assert names[:5] == ["bash", "read_file", "write_file", "edit", "python"]
    assert {"screenshot", "left_click", "right_click", "double_click", "move_mouse", "drag", "scroll",
            "type_text", "press_key", "wait", "launch", "open"} <= set(names)
    assert ts.spec("screenshot").read_only and not ts.spec("left_click").read_only
    assert all(t["type"] == "function" for t in ts.openai_tools())


@pytest.mark.integration
@needs_x
def test_tools_drive_a_real_desktop_and_bad_calls_are_tool_errors(family):
    ws = family.create(desktop="400x300")
    ts = ToolSet.desktop()
    shot = ts.run_sync(ws, "screenshot", {})
    assert shot.ok and shot.output == "screenshot 400x300" and _png(shot).size == (400, 300)
    assert shot.content()[1]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")

    bad = {
        ("left_click", '{"x": 400, "y": 10}'): "off the 400x300 screen",
        ("double_click", '{"x": 5, "y": 300}'): "off the 400x300 screen",
        ("drag", '{"start_x": 0, "start_y": 0, "end_x": 999, "end_y": 1}'): "off the",
        ("move_mouse", '{"x": -1, "y": 0}'): "must be >= 0",
        ("press_key", '{"keys": "ctrl+hyper"}'): "unknown key 'hyper'",
        ("press_key", '{"keys": "ctrl+"}'): "empty part",
        ("scroll", '{"direction": "sideways"}'): "must be one of",
        ("scroll", '{"x": 3}'): "both x and y",
        ("wait", '{"seconds": 600}'): "arguments.seconds",
        ("launch", '{"app": "no-such-app"}'): "no program",
        ("open", '{"target": "relative.txt"}'): "neither an absolute path",
        ("type_text", '{"text": ""}'): "text",
    }
    for (name, args), words in bad.items():
        obs = ts.run_sync(ws, name, args)
        assert obs.error and words in obs.error, (name, obs)
    assert ts.run_sync(ws, "screenshot", {}).images == shot.images  # none of them reached the screen

    ws.files.write("/root/notes.txt", "first line\n")
    opened = ts.run_sync(ws, "open", {"target": "/root/notes.txt"})
    assert opened.ok and "xedit" in opened.output
    launched = ts.run_sync(ws, "launch", {"app": "xterm -geometry 30x6+0+0"})
    assert launched.ok and "xterm" in launched.output
    assert ts.run_sync(ws, "left_click", {"x": 60, "y": 40}).ok  # focus the xterm
    assert ts.run_sync(ws, "type_text", {"text": "echo typed > /tmp/t"}).ok
    assert ts.run_sync(ws, "press_key", {"keys": "Return"}).ok
    assert ts.run_sync(ws, "wait", {"seconds": 0.3}).ok
    assert ws.files.read_text("/tmp/t") == "typed\n"  # the keys went to the xterm's shell
    after = ts.run_sync(ws, "screenshot", {})
    assert after.images != shot.images
    for name, args in (("right_click", {"x": 300, "y": 250}), ("press_key", {"keys": "Escape"}),
                       ("scroll", {"direction": "up", "amount": 2, "x": 60, "y": 40}),
                       ("move_mouse", {"x": 1, "y": 1}), ("drag", {"start_x": 1, "start_y": 1, "end_x": 5,
                                                                  "end_y": 5})):
        assert ts.run_sync(ws, name, args).ok, name


@pytest.mark.integration
@needs_x
def test_no_desktop_is_a_tool_error(family):
    obs = ToolSet.desktop().run_sync(family.create(), "screenshot", {})
    assert obs.error and "has no desktop" in obs.error and "--desktop" in obs.error


@pytest.mark.integration
@pytest.mark.criu
@needs_x
def test_cached_desktop_calls_replay_the_screen_and_fork_its_state(no_leaks):
    """A second trajectory with the same calls is served from the cache (screenshots
    included); its first new call runs on a fork of the cached state, whose screen is the
    one the cached screenshot showed."""
    ws = Workspace.create("host", memory="1G", config=no_leaks, desktop="400x300")
    try:
        root = ws.snapshot()
    finally:
        ws.remove()
    calls = [("launch", {"app": "xterm -geometry 30x6+0+0"}), ("left_click", {"x": 60, "y": 40}),
             ("type_text", {"text": "echo from-the-cache"}), ("screenshot", {})]

    async def go():
        cache = PrefixCache(ToolSet.desktop(), policy=CachePolicy(snapshot_min_s=0.0))
        try:
            first = cache.start(root)
            a = [await first.call(n, args) for n, args in calls]
            await first.close()
            second = cache.start(root)
            b = [await second.call(n, args) for n, args in calls]
            assert all(o.cached for o in b) and not any(o.cached for o in a)
            fresh = await second.call("screenshot", {})  # a read-only call: served by a real fork
            await second.close()
            return a, b, fresh
        finally:
            await cache.aclose()

    try:
        a, b, fresh = asyncio.run(go())
    finally:
        root.remove()
    assert a[-1].images == b[-1].images
    assert fresh.images == a[-1].images and not fresh.cached
