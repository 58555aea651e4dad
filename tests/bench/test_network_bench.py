"""``bunshin bench network``'s parts run end to end (small) against the test internet and
report each side; a hostile workload's reach is the measurement the mechanism is chosen on."""

from __future__ import annotations

import shutil

import pytest

from bunshin.bench import network as bench_network

pytestmark = [pytest.mark.integration, pytest.mark.criu]


def test_bench_network_parts(no_leaks, internet):
    fork = bench_network.fork_side_by_side(no_leaks, 1)
    assert fork["off"]["restore_ms"] > 0 and fork["on"]["restore_ms"] > 0 and fork["restore_on_over_off"] > 0
    t = bench_network.throughput(no_leaks, internet, 1 << 20)
    assert t["egress"]["ok"] and t["egress"]["bytes"] == 1 << 20 and t["egress"]["mb_per_s"] > 0
    assert t["ports_in"]["ok"] and t["host_direct_mb_per_s"] > 0
    clones = bench_network.clones_fetch(no_leaks, internet, 2)
    assert clones["clones"] == 2 and clones["fetched"] <= 2 and clones["wall_ms"] > 0
    if shutil.which("pasta") is None:
        pytest.skip("pasta is not installed (apt package passt: `make install`)")
    m = bench_network.mechanism(no_leaks, internet, 1, 1 << 20, 0.0)
    veth, pasta = m["veth_nftables"]["reach"], m["pasta"]["reach"]
    assert veth["internet_web"] == pasta["internet_web"] == "reached"
    assert not {k for k, v in veth.items() if v == "reached"} - {"internet_web"}, veth  # the policy holds
    assert pasta["host_loopback_service"] == "reached", pasta  # pasta maps its gateway to the host
    assert m["pasta"]["throughput"]["ok"] and m["pasta"]["setup_ms"] > 0
