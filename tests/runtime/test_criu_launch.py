"""criu started through the prefix's loader directly: the same criu as its wrapper runs, or the wrapper."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bunshin.runtime.criu import launch as criu_launch


def _run(argv: tuple[str, ...], *args: str) -> str:
    return subprocess.run([*argv, *args], capture_output=True, text=True, check=True, timeout=30).stdout


@pytest.mark.criu
def test_the_installed_wrapper_is_run_as_the_command_it_execs(cfg):
    argv = criu_launch.argv(cfg.criu)
    if argv == (str(cfg.criu),):
        pytest.skip(f"{cfg.criu} is not the wrapper make install writes")
    assert argv[1] == "--library-path" and Path(argv[0]).name.startswith("ld-linux")
    assert _run(argv, "--version") == _run((str(cfg.criu),), "--version")


def _wrapper(prefix: Path, *, marker: bool = True) -> Path:
    """A wrapper as ``install_criu.sh`` writes it, in a prefix with a loader and a binary."""
    (prefix / "bin").mkdir(parents=True)
    for rel in ("root/lib64/ld.so", "root/usr/sbin/criu"):
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_text("#!/bin/sh\n")
        (prefix / rel).chmod(0o755)
    script = prefix / "bin" / "criu"
    script.write_text(
        "#!/bin/sh\n# CRIU in a private prefix. " + (criu_launch.MARKER + ".\n" if marker else "\n")
        + 'here=$(dirname "$(readlink -f "$0")")\nROOT=${here%/bin}/root\n'
        + 'exec "$ROOT/lib64/ld.so" --library-path "$ROOT/usr/lib:$ROOT/lib" \\\n    "$ROOT/usr/sbin/criu" "$@"\n')
    script.chmod(0o755)
    return script


def test_a_generated_wrapper_becomes_its_loader_command(tmp_path):
    script = _wrapper(tmp_path / "p")
    root = str(tmp_path / "p" / "root")
    assert criu_launch.argv(script) == (f"{root}/lib64/ld.so", "--library-path", f"{root}/usr/lib:{root}/lib",
                                        f"{root}/usr/sbin/criu")


def test_anything_else_is_run_as_given(tmp_path):
    other = _wrapper(tmp_path / "q", marker=False)  # not bunshin's: its shell may do more
    assert criu_launch.argv(other) == (str(other),)
    gone = _wrapper(tmp_path / "r")
    (tmp_path / "r" / "root" / "usr" / "sbin" / "criu").unlink()  # the prefix is broken: the wrapper says how
    assert criu_launch.argv(gone) == (str(gone),)
    assert criu_launch.argv(tmp_path / "missing") == (str(tmp_path / "missing"),)
    assert criu_launch.argv(Path("/bin/true")) == ("/bin/true",)


def _seeds_gnutls(argv: tuple[str, ...], env: dict[str, str]) -> bool:
    """Whether ``criu --version`` run with ``env`` initialised gnutls (its RNG seeds itself
    with a blocking 32-byte ``getrandom``)."""
    out = subprocess.run(["strace", "-f", "-e", "trace=getrandom", *argv, "--version"], capture_output=True,
                         text=True, check=True, timeout=30, env=env).stderr
    return any("getrandom(" in line and ", 32, 0)" in line for line in out.splitlines())


@pytest.mark.criu
def test_criu_runs_without_gnutls_initialising_itself(cfg):
    import os
    import shutil

    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    argv = criu_launch.argv(cfg.criu)
    plain = {k: v for k, v in os.environ.items() if k not in criu_launch.ENV}
    assert _seeds_gnutls(argv, plain)  # the control: gnutls's constructor runs by default
    assert not _seeds_gnutls(argv, criu_launch.env())
    assert _run(argv, "--version").startswith("Version:")
