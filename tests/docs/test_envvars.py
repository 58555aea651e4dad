"""The table of BUNSHIN_* variables (docs/gen/envvars.py) covers the code exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "gen"))
import envvars  # noqa: E402


def test_every_variable_in_the_code_has_a_row():
    found = envvars.scan(ROOT)
    assert "BUNSHIN_HOME" in found and "BUNSHIN_GHOST_LIMIT" in found
    envvars.check(found)  # raises naming the missing or stale ones
    page = envvars.render(found)
    for name in found:
        assert f"| `{name}` |" in page


def test_an_undescribed_variable_fails_the_build(tmp_path):
    name = "BUNSHIN_" + "NOT_DESCRIBED_YET"  # spelled apart: this file is scanned too
    (tmp_path / "bunshin").mkdir()
    (tmp_path / "bunshin" / "x.py").write_text(f'os.environ.get("{name}")\n')
    found = envvars.scan(tmp_path)
    assert found == {name: ["bunshin/x.py"]}
    with pytest.raises(SystemExit, match=name):
        envvars.check(found)
