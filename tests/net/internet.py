"""The ``internet`` fixture: a stand-in for the internet that any test may use.

Registered for the whole suite by ``pytest_plugins`` in ``tests/conftest.py``; one per
test session, made on first use (~0.3 s) and taken down at the end (also when the run
dies: its servers exit when this process goes, and the kernel deletes their namespace).
Everything lives in ``bunshin.bench.internet`` (``bunshin bench network`` uses it too)::

    def test_fetch(internet):                      # an ``Internet``
        internet.web, internet.other               # HTTP servers, port 80 ("203.0.113.8k+1", +2)
        internet.url("/files/hello.txt")           # http://<web>/files/hello.txt
        internet.url("/bytes/1000000")             # 1 MB, byte i == i % 256, full speed
        internet.url("/slow/4000000?rate=262144")  # the same paced at 256 KiB/s (fork mid-download)
        internet.url("/whoami")                    # the client address the server saw (after NAT)
        internet.files / "x.bin"                   # write a file here, fetch /files/x.bin
        internet.index_url                         # PEP 503 index: pip install bunshin-netprobe
        internet.pip_args                          # --index-url, --trusted-host, ... (and set
        #   PIP_CONFIG_FILE=/dev/null: this machine's pip.conf adds local indexes)
        #   (module ``netprobe``; depends on bunshin-netprobe-dep, module ``netprobe_dep``)
        internet.dns                               # DNS server (UDP/TCP 53): web.inet.test,
        internet.add_name("*.ok.test", internet.web)  # other.inet.test, pypi.inet.test; add more
        internet.requests()                        # access log: client, port, path, sent, error
        internet.wait_request("/slow/4000000")     # the entry once that response ended
        internet.dns_queries()                     # every DNS question the server was asked
        internet.subnet, internet.link             # "203.0.113.8k/29" routed via host link bsinet<k>

The host reaches these addresses through the link at once; a workspace reaches them when
the host forwards and NATs its traffic (egress). They are TEST-NET addresses (RFC 5737),
which Python's ``ipaddress`` counts as private: a policy that denies private ranges must
allow ``internet.subnet`` (or names under it) for a test to get through.
"""

from __future__ import annotations

import os

import pytest

from bunshin.bench.internet import Internet


@pytest.fixture(scope="session")
def internet(tmp_path_factory: pytest.TempPathFactory):
    """The session's test internet (see the module's docstring)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace, a veth link, a route): run the tests as root")
    with Internet.start(tmp_path_factory.mktemp("internet")) as inet:
        yield inet
