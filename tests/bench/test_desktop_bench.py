"""``bunshin bench desktop``: refuses bad plans, and a tiny real run has the report's shape."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from bunshin.bench import desktop as bench
from bunshin.errors import InvalidArgument


@pytest.mark.parametrize("kw", [{"app": "libreoffice"}, {"clones": 1}, {"group": 0}, {"cold": -1}])
def test_bad_plans_are_refused(kw):
    with pytest.raises(InvalidArgument):
        bench.DesktopPlan(**kw)


@pytest.mark.integration
@pytest.mark.criu
@pytest.mark.skipif(any(shutil.which(p) is None for p in ("Xvfb", "jwm", "xdotool", "xedit")),
                    reason="needs xvfb, x11-apps, xdotool and jwm: run `make install`")
def test_tiny_run_reports_fork_copy_cold_rollout_and_screens(no_leaks, tmp_path):
    plan = bench.DesktopPlan(app="xedit", clones=2, cold=1, group=2, think_s=0.05)
    r = bench.run(no_leaks, plan, out=tmp_path)
    for side in ("bunshin", "copy"):
        s = r[side]
        assert s["clones"] == 2 and s["pixel_equal_clones"] == 2 and s["restore_ms_p50"] > 0
    # copy-on-write: a clone owns far less than a plain CRIU clone (which copies every page)
    assert r["bunshin"]["private_bytes_per_clone"] * 4 < r["copy"]["private_bytes_per_clone"]
    assert r["cold"]["n"] == 1 and r["cold"]["start_ms_p50"] > 0
    assert r["diverged"] == {"clones_differ": True, "a_differs_from_parent": True, "b_differs_from_parent": True}
    for mode in ("baseline", "bunshin"):
        g = r["rollout"][mode]
        assert g["rewards"] == [1.0, 1.0] and g["failed"] == 0, g
    assert r["rollout"]["bunshin"]["prepare_s"] > 0 and r["rollout"]["baseline"]["prepare_s"] == 0
    for name in ("parent.png", "clone-a.png", "clone-b.png"):
        assert Image.open(tmp_path / name).size == (1280, 800)
    report = (tmp_path / "report.md").read_text()
    assert "![clone A](clone-a.png)" in report and "| bunshin |" in report and "| baseline |" in report
    assert json.loads((tmp_path / "results.json").read_text())["plan"]["clones"] == 2
