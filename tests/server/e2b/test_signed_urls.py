"""Integration: the file URLs the unmodified e2b SDK signs (``download_url`` / ``upload_url``)
open envd's ``/files`` without the access token, for their one path, operation and user and
until their expiration; any other use of them is refused (401), as is a signature made with
another sandbox's token. Over real loopback HTTP; the client sends only the routing header a
host name would carry."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import Sandbox  # noqa: E402
from e2b.sandbox.signature import get_signature  # noqa: E402

from bunshin.server.e2b.auth import envd_access_token  # noqa: E402
from tests.conftest import leftovers  # noqa: E402

from .envd_fixtures import TOKEN, Env, served  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def env(cfg) -> Env:
    with served(cfg) as e:
        yield e
    assert leftovers(cfg) == {}


@pytest.fixture(scope="module")
def sbx(env: Env) -> Sandbox:
    return env.sandbox(Sandbox)


def _get(env: Env, url: str) -> httpx.Response:
    return httpx.get(url, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30)


def _with(url: str, **changes: str) -> str:
    """``url`` with query parameters replaced."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True)) | changes
    return urlunsplit(parts._replace(query=urlencode(query)))


def test_a_signed_download_url_reads_its_file_without_the_token(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/signed.txt", "signed content")
    r = _get(env, sbx.download_url("/tmp/signed.txt"))
    assert (r.status_code, r.text) == (200, "signed content")
    r = _get(env, sbx.download_url("/tmp/signed.txt", use_signature_expiration=60))
    assert (r.status_code, r.text) == (200, "signed content")


def test_a_signed_url_opens_nothing_else(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/other.txt", "not for this URL")
    url = sbx.download_url("/tmp/signed-only.txt")
    refused = {
        "another path": _with(url, path="/tmp/other.txt"),
        "another user": _with(url, username="root"),
        "a changed signature": _with(url, signature="v1_" + "A" * 43),
        "an expiration added": _with(url, signature_expiration="9999999999"),
        "another route": url.replace("/files?", "/envs?"),
    }
    for what, bad in refused.items():
        r = _get(env, bad)
        assert r.status_code == 401, (what, r.status_code, r.text)
        assert "other.txt" not in r.text
    # the token of another sandbox signs nothing here
    other = get_signature("/tmp/other.txt", "read", "user", envd_access_token(TOKEN, "ws-0123456789ab"))
    r = _get(env, _with(url, path="/tmp/other.txt", signature=other["signature"]))
    assert r.status_code == 401


def test_an_expired_signature_is_refused_by_name(env: Env, sbx: Sandbox) -> None:
    sbx.files.write("/tmp/expiring.txt", "x")
    url = sbx.download_url("/tmp/expiring.txt", use_signature_expiration=60)
    user = dict(parse_qsl(urlsplit(url).query)).get("username")
    gone = get_signature("/tmp/expiring.txt", "read", user, env.access_token, expiration_in_seconds=-5)
    r = _get(env, _with(url, signature=gone["signature"], signature_expiration=str(gone["expiration"])))
    assert r.status_code == 401 and "expired" in r.json()["message"]
    r = _get(env, _with(url, signature_expiration="soon"))
    assert r.status_code == 401 and "Unix time" in r.json()["message"]


def test_a_signed_upload_url_writes_its_one_path(env: Env, sbx: Sandbox) -> None:
    url = sbx.upload_url("/tmp/uploaded.txt")
    # a browser's form names the part after the user's file: the URL's path is what is written
    r = httpx.post(url, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30,
                   files={"file": ("report.txt", b"from a form", "text/plain")})
    assert r.status_code == 200, r.text
    assert sbx.files.read("/tmp/uploaded.txt") == "from a form"
    assert not sbx.files.exists("report.txt")
    # a read URL does not write, a write URL does not read
    read = sbx.download_url("/tmp/uploaded.txt")
    r = httpx.post(read, headers={"E2b-Sandbox-Id": env.ws.id}, timeout=30, files={"file": ("x", b"overwrite")})
    assert r.status_code == 401
    assert _get(env, url).status_code == 401
    assert sbx.files.read("/tmp/uploaded.txt") == "from a form"
