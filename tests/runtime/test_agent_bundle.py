"""Which Python the agent layer is made of (``agent_python``)."""

from __future__ import annotations

import os
import sys

import pytest

from bunshin.errors import InvalidArgument
from bunshin.runtime.agent_host import bundle as agent_bundle
from bunshin.runtime.agent_host.bundle import PYTHON_ENV, _pyenv_pythons, agent_python


def test_the_variable_names_the_python(monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    python = agent_python()
    assert python.version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert python.binary.is_file() and python.stdlib.is_dir()


@pytest.mark.parametrize("bad", ["/bin/true", "/nonexistent/python3", "sh"])
def test_a_variable_that_is_no_python_is_refused_with_a_hint(monkeypatch, bad):
    monkeypatch.setenv(PYTHON_ENV, bad)
    with pytest.raises(InvalidArgument) as exc:
        agent_python()
    assert PYTHON_ENV in str(exc.value) and "unset it" in (exc.value.hint or "")


def test_without_the_variable_a_python_that_runs_is_chosen(monkeypatch, tmp_path):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    shim = tmp_path / "bin" / "python3.12"  # on PATH but does not run (a pyenv shim without the version)
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:{os.environ['PATH']}")
    python = agent_python()
    assert python.binary != shim
    assert tuple(map(int, python.version.split("."))) >= (3, 11)


def test_pyenv_versions_newest_first(tmp_path):
    for version in ("3.12.1", "3.12.10", "3.12.9", "3.11.7", "system"):
        binary = tmp_path / "versions" / version / "bin" / "python3.12"
        binary.parent.mkdir(parents=True)
        if version != "3.11.7":
            binary.write_text("")
    found = _pyenv_pythons(str(tmp_path), "python3.12")
    assert [p.split("/")[-3] for p in found] == ["3.12.10", "3.12.9", "3.12.1"]
    assert _pyenv_pythons(str(tmp_path / "none"), "python3.12") == []


def test_the_layer_name_follows_the_python(monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, sys.executable)
    host, host_name = agent_python(), agent_bundle.current_layer_name()
    monkeypatch.delenv(PYTHON_ENV)
    chosen, chosen_name = agent_python(), agent_bundle.current_layer_name()
    assert (host_name == chosen_name) == (host == chosen)
