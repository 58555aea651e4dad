"""The head's image mover (cluster/images) over three real servers on loopback (no Ray
needed: the mover only talks HTTP): a host lacking the image gets it from a live holder,
once however many placements ask at the same time; a dead holder is not asked; with no
live holder nothing moves (the host resolves the name itself)."""

from __future__ import annotations

import os
import threading
from contextlib import ExitStack
from pathlib import Path

import pytest

from bunshin.client import Client
from bunshin.cluster.images import ImageMover
from bunshin.config import Config
from bunshin.runtime.oci import store as oci_store
from bunshin.runtime.state.store import Store
from bunshin.server.thread import serve_in_thread
from tests.conftest import drop_state_tmpfs
from tests.runtime import oci_images as oi

TOKEN = "cluster-images-token-0123456789ab"
NAME = "test/mover:v1"


@pytest.fixture
def hosts(tmp_path: Path):
    key = os.urandom(32)
    cfgs = {}
    for n in ("a", "b", "c"):
        cfg = Config.for_home(tmp_path / n)
        cfg.home.mkdir(parents=True)
        fd = os.open(cfg.snapshot_key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, key)
        os.close(fd)
        cfgs[n] = cfg
    oi.build_layout(tmp_path / "img", [oi.busybox_base(), oi.Layer().add("srv", "dir").add("srv/x", "file", "x\n")])
    with Store.open(cfgs["a"].db_path) as store:
        oci_store.load(cfgs["a"], store, tmp_path / "img", tags=[NAME])
    with ExitStack() as stack:
        clients = {n: stack.enter_context(Client(stack.enter_context(serve_in_thread(c, TOKEN)), token=TOKEN))
                   for n, c in cfgs.items()}
        yield clients, cfgs
    for cfg in cfgs.values():
        drop_state_tmpfs(cfg)


def test_a_host_lacking_the_image_gets_it_once_from_a_live_holder(hosts) -> None:
    clients, cfgs = hosts
    mover = ImageMover(clients, set())
    assert mover.ensure("host", "b") is None and mover.ensure(None, "b") is None
    assert mover.ensure(NAME, "a") is None, "the holder needs nothing"
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(mover.ensure(NAME, "b"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    moves = [m for m in got if m is not None]
    assert len(moves) == 1 and len(mover.done.moves) == 1, "four placements at once: one move"
    (m,) = moves
    assert (m.host, m.source, m.layers_sent, m.layers_skipped) == ("b", "a", 2, 0) and m.bytes > 0
    assert clients["b"].images.holds(NAME) and mover.done.bytes == m.bytes


def test_a_dead_holder_is_not_asked_and_no_live_holder_moves_nothing(hosts) -> None:
    clients, cfgs = hosts
    mover = ImageMover(clients, {"a"})
    assert mover.ensure(NAME, "c") is None and mover.done.moves == []
    assert not clients["c"].images.holds(NAME), "nothing moved from a host given up"
    mover.dead.discard("a")
    assert mover.ensure(NAME, "c") is not None and clients["c"].images.holds(NAME)
