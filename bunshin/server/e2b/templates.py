"""E2B templates on bunshin: a template id names a snapshot, so creating a sandbox is a
restore, never a boot.

- ``base`` (the SDK's default) is :data:`BASE_IMAGE`, and so are the defaults of E2B's other
  SDKs (:data:`BUILTIN`: ``code-interpreter-v1``, whose interpreter runs the image's
  ``python3``, and ``desktop``, whose SDK starts Xvfb and XFCE in it; ``make install`` puts
  them on the host); any other image reference the server
  holds (``python:3.12``) names that image. The first create from an image boots it once,
  snapshots it and removes the workspace; the snapshot is the template from then on
  (records of kind ``e2b-template``, so a restarted server keeps them).
- a snapshot taken through E2B (``POST /sandboxes/{id}/snapshots``) is a template by its
  id (``snap-...``) and by the name it was given.

Building templates (``POST /v3/templates``, Dockerfiles) is not bunshin's: images come in
with ``bunshin image`` and a template is made from one on first use.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

from ...config import Config
from ...errors import InvalidArgument, NotFound, RuntimeFailure, SnapshotNotFound
from ...runtime.state.store import Store
from ...workspace import Snapshot, Workspace
from ..images import image_id
from .keylocks import KeyLocks

KIND = "e2b-template"
#: The image the ``base`` template is made from.
BASE_IMAGE = "host"
BASE = "base"
#: Templates named by E2B's SDKs' defaults, and the images they are made from.
BUILTIN = {BASE: BASE_IMAGE, "code-interpreter-v1": BASE_IMAGE, "desktop": BASE_IMAGE}
#: What a builtin template's workspace runs once, before it is snapshotted: E2B's desktop image
#: has noVNC at /opt/noVNC (``Sandbox.stream`` runs it from there); the host image shows no
#: /opt, so the template names the host's Debian noVNC there, in its own layer.
SETUP = {"desktop": ["sh", "-c", "if [ -d /usr/share/novnc ]; then mkdir -p /opt && ln -sfn /usr/share/novnc /opt/noVNC; fi"]}
#: Memory and pids limits of a template's sandboxes (E2B's default sandbox has 512 MiB).
SANDBOX_MEMORY = "512M"
SANDBOX_PIDS = 512
#: The id of an image template's snapshot with internet access: ``<template id>@egress``.
EGRESS_SUFFIX = "@egress"
_SNAP_ID = re.compile(r"snap-[0-9a-f]{12}")


@dataclass(frozen=True)
class TemplateRecord:
    """A template: the snapshot it restores, made from ``image`` (booted once) or from the
    sandbox ``source`` (a snapshot taken through E2B); ``names`` it is also found by."""

    id: str
    snapshot: str
    kind: Literal["image", "snapshot"]
    created_at: float
    image: str | None = None
    source: str | None = None
    names: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TemplateRecord:
        return cls(**json.loads(text))


class Templates:
    """The templates of one server; one lock per template id, so two first creates of an
    image boot it once."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._locks = KeyLocks()  # the key is the client's templateID: none may stay behind

    def all(self) -> list[TemplateRecord]:
        with Store.open(self._config.db_path) as store:
            return [TemplateRecord.from_json(raw) for _, raw in store.list_objects(KIND)]

    def find(self, ref: str) -> TemplateRecord | None:
        """The template whose id or one of whose names is ``ref`` (a ``:tag`` after it ignored)."""
        ref = ref.split(":", 1)[0] if ref.endswith(":default") else ref
        with Store.open(self._config.db_path) as store:
            raw = store.get_object(KIND, ref)
            if raw is not None:
                return TemplateRecord.from_json(raw)
            for _, raw in store.list_objects(KIND):
                rec = TemplateRecord.from_json(raw)
                if ref in rec.names:
                    return rec
        return None

    def put(self, rec: TemplateRecord) -> None:
        with Store.open(self._config.db_path) as store:
            store.put_object(KIND, rec.id, rec.to_json())

    def snapshot_of(self, template_id: str, *, egress: bool = False) -> tuple[Snapshot, str]:
        """The snapshot a sandbox of ``template_id`` restores, and the template's id; made
        from its image the first time. ``egress``: one whose workspace has internet access
        (an image's template then has a second snapshot, booted with egress, under
        ``<id>@egress``; a snapshot's template must have been taken with it).
        :class:`NotFound` if it names neither a template, nor a snapshot, nor an image."""
        rec = self.find(template_id)
        if (rec is not None and rec.kind == "snapshot") or (rec is None and _SNAP_ID.fullmatch(template_id)):
            snap = Snapshot.get(rec.snapshot if rec else template_id, config=self._config)
            if egress and snap.record.network != "egress":
                raise InvalidArgument(f"template {template_id!r} is a snapshot of a sandbox without internet access: "
                                      "it restores without network",
                                      hint="use an image template ('base' or an image reference), or a snapshot "
                                           "of a sandbox created with allow_internet_access=True")
            return snap, rec.id if rec else template_id
        base_id = rec.id if rec is not None else template_id
        key = f"{base_id}{EGRESS_SUFFIX}" if egress else base_id
        with self._locks.held(key):
            made = self.find(key)
            if made is not None:
                try:
                    return Snapshot.get(made.snapshot, config=self._config), base_id
                except SnapshotNotFound:  # removed by bunshin's own API: made anew from its image
                    self.remove(made)
            image = rec.image if rec is not None and rec.image else self.image_of(template_id)
            return self._from_image(key, image, egress, SETUP.get(base_id)), base_id

    def image_of(self, template_id: str) -> str:
        """The image a template name that no record holds names (``base`` and E2B's other
        defaults: :data:`BUILTIN`); :class:`NotFound` if it is not an image held here."""
        try:
            return image_id(self._config, BUILTIN.get(template_id, template_id), field="templateID")
        except Exception as e:  # not an image reference, or none held here: not a template
            raise NotFound(f"template {template_id!r} not found: not a template, snapshot or image on this "
                           "server", hint="use 'base', a snapshot id, or an image `bunshin image ls` shows"
                           ) from e

    def _from_image(self, template_id: str, image: str, egress: bool, setup: list[str] | None = None) -> Snapshot:
        """Boot ``image`` once (with internet access if ``egress``), run ``setup`` in it,
        snapshot it, remove the workspace: the template's snapshot."""
        ws = Workspace.create(image, memory=SANDBOX_MEMORY, pids=SANDBOX_PIDS, config=self._config,
                              network="egress" if egress else "none")
        try:
            if setup is not None and not (done := ws.exec(setup, timeout=60)).ok:
                raise RuntimeFailure(f"template {template_id!r}: its setup failed ({done.exit_code}): "
                                     f"{done.stderr.strip()[-500:]}", hint="run `make install` (the e2b extra)")
            snap = ws.snapshot()
        finally:
            ws.remove()
        self.put(TemplateRecord(template_id, snap.id, "image", time.time(), image=image))
        return snap

    def add_snapshot(self, snap: Snapshot, source: str, name: str | None) -> TemplateRecord:
        """A snapshot taken through E2B, as a template (by its id, and by ``name``: a name
        already used moves to this snapshot, as E2B's new build of a named template does)."""
        names = [name] if name else []
        if name:
            old = self.find(name)
            if old is not None and old.kind == "snapshot":
                self.put(TemplateRecord(old.id, old.snapshot, old.kind, old.created_at, old.image, old.source,
                                        [n for n in old.names if n != name]))
        rec = TemplateRecord(snap.id, snap.id, "snapshot", time.time(), source=source, names=names)
        self.put(rec)
        return rec

    def remove(self, rec: TemplateRecord) -> None:
        """Drop the template and its snapshot (sandboxes restored from it keep running)."""
        with Store.open(self._config.db_path) as store:
            store.delete_object(KIND, rec.id)
        try:
            Snapshot.get(rec.snapshot, config=self._config).remove()
        except SnapshotNotFound:
            pass
