"""The home's resolver process: started on a port bound before it runs, or a clear error."""

from __future__ import annotations

import socket

import pytest

from bunshin.config import Config
from bunshin.errors import RuntimeFailure
from bunshin.runtime.net import resolver
from bunshin.runtime.state.store import Store


def test_a_taken_port_is_a_clear_error_and_starts_nothing(tmp_path) -> None:
    """Another program on the home's resolver port: ``ensure`` says so, naming the holder,
    and records no resolver (before, the resolver died unseen and every lookup timed out)."""
    cfg = Config.for_home(tmp_path / "home")
    cfg.paths.home.mkdir(parents=True, exist_ok=True)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        try:
            squatter.bind(("127.0.0.1", resolver.port(cfg)))
        except OSError:
            pytest.skip(f"port {resolver.port(cfg)} is in use on this machine already")
        with Store.open(cfg.db_path) as store:
            with pytest.raises(RuntimeFailure, match=f"UDP port {resolver.port(cfg)}") as info:
                resolver.ensure(cfg, store)
            assert "held by pid" in info.value.message and "BUNSHIN_HOME" in (info.value.hint or "")
            assert store.get_object(resolver.KIND, "0") is None
    finally:
        squatter.close()
