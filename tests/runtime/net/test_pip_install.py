"""The headline: `pip install` inside a workspace with egress, from the test internet's index."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_pip_install_from_the_index_in_an_egress_workspace(family, internet):
    ws = family.create(network="egress")
    pip = ["python3", "-m", "pip", "install", "-q", *internet.pip_args, "--target", "/tmp/site", "bunshin-netprobe"]
    r = ws.exec(pip, env={"PIP_CONFIG_FILE": "/dev/null"}, timeout=180)
    assert r.exit_code == 0, r.stderr[-2000:]
    r = ws.exec(["python3", "-c", "import netprobe; print(netprobe.ANSWER)"], env={"PYTHONPATH": "/tmp/site"})
    assert r.stdout.strip() == "42", r.stderr
    # both wheels came from the index, fetched by the workspace (its own address, after NAT)
    got = [q for q in internet.requests() if q["path"].startswith("/packages/")]
    assert {q["path"].split("/")[-1].split("-")[0] for q in got} == {"bunshin_netprobe", "bunshin_netprobe_dep"}
    assert {q["client"] for q in got} == {internet.host_addr}


def test_pip_fails_without_egress(family, internet):
    ws = family.create()
    pip = ["python3", "-m", "pip", "install", "-q", *internet.pip_args, "--timeout", "2", "--retries", "0",
           "--target", "/tmp/site", "bunshin-netprobe"]
    r = ws.exec(pip, env={"PIP_CONFIG_FILE": "/dev/null"}, timeout=120)
    assert r.exit_code != 0 and "bunshin-netprobe" in r.stderr
