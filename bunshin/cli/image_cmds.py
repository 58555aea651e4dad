"""CLI commands on images: ``bunshin image load|pull|build|ls|inspect|rm``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from datetime import datetime

from .. import console as output
from ..config import Config
from ..runtime.oci import store as oci_store
from ..runtime.state.store import Store
from ..runtime.upkeep import gc


def register(sub: argparse._SubParsersAction) -> None:
    image = sub.add_parser("image", help="OCI/Docker images: load, pull, build, ls, inspect, rm")
    isub = image.add_subparsers(dest="image_command", metavar="SUBCOMMAND")
    isub.required = True

    p = isub.add_parser("load", help="load a `docker save` archive, an OCI archive or an OCI layout folder "
                                     "(.tar, .tar.gz, .tar.zst)")
    p.add_argument("file")
    p.add_argument("--tag", action="append", default=[], metavar="REF", help="also name the image REF")
    _caps(p)
    p.add_argument("--json", action="store_true", help="print the loaded images as JSON")
    p.set_defaults(func=cmd_load)

    p = isub.add_parser("pull", help="pull REF[@sha256:...] from a registry (through skopeo)")
    p.add_argument("ref")
    _caps(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = isub.add_parser("build", help="build DIR's Dockerfile (through buildah, RUN steps in a user namespace)")
    p.add_argument("dir")
    p.add_argument("-f", "--file", default="Dockerfile", help="the Dockerfile's name in DIR (default Dockerfile)")
    p.add_argument("-t", "--tag", action="append", default=[], metavar="REF", help="name the image REF")
    p.add_argument("--network", default="none", metavar="none|egress|host",
                   help="RUN steps' network: none (default: their own namespace, loopback only); host (the "
                        "host's: every service on its loopback; warns); egress is not supported yet")
    _caps(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_build)

    p = isub.add_parser("ls", help="list stored images")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = isub.add_parser("inspect", help="an image's layers and config")
    p.add_argument("ref")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = isub.add_parser("rm", help="remove images (by name or id); frees the layers nothing else uses")
    p.add_argument("refs", nargs="+")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_rm)


def _caps(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-size", metavar="SIZE", help="refuse an image that unpacks to more (default "
                   "BUNSHIN_IMAGE_MAX_BYTES or 32G)")
    p.add_argument("--max-layers", metavar="N", help="refuse an image of more layers (default "
                   "BUNSHIN_IMAGE_MAX_LAYERS or 125)")


def _config(args: argparse.Namespace) -> Config:
    """The config from the environment, with the command's caps."""
    cfg = Config.from_env()
    if args.max_size is not None:
        cfg = dataclasses.replace(cfg, image_max_bytes=args.max_size)
    if args.max_layers is not None:
        cfg = dataclasses.replace(cfg, image_max_layers=args.max_layers)
    return cfg


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


class _Status:
    """Progress on stderr: on a terminal one live status line (a spinner with the step),
    elsewhere one line per step (skopeo's and the unpacking's)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.live = None if quiet or not sys.stderr.isatty() else output.err.status("")

    def __enter__(self) -> oci_store.Progress:
        if self.quiet:
            return oci_store.quiet
        if self.live is None:
            return lambda line: print(line, file=sys.stderr, flush=True)
        self.live.start()
        live = self.live
        return lambda line: live.update(line)

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


def _progress(args: argparse.Namespace) -> _Status:
    return _Status(bool(args.json))


def cmd_load(args: argparse.Namespace) -> int:
    cfg = _config(args)
    t0 = time.perf_counter()
    with Store.open(cfg.db_path) as store, _progress(args) as progress:
        recs = oci_store.load(cfg, store, args.file, tags=args.tag, progress=progress)
    if args.json:
        output.print_json({"images": [r.summary() for r in recs], "seconds": round(time.perf_counter() - t0, 3)})
    else:
        for r in recs:
            print(r.id)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from ..runtime.oci.pull import pull

    cfg = _config(args)
    t0 = time.perf_counter()
    with Store.open(cfg.db_path) as store, _progress(args) as progress:
        rec = pull(cfg, store, args.ref, progress=progress)
    if args.json:
        output.print_json({**rec.summary(), "seconds": round(time.perf_counter() - t0, 3)})
    else:
        print(rec.id)
    return 0


def cmd_build(args: argparse.Namespace) -> int:
    from ..runtime.oci.build import build

    cfg = _config(args)
    t0 = time.perf_counter()
    with Store.open(cfg.db_path) as store, _progress(args) as progress:
        rec = build(cfg, store, args.dir, dockerfile=args.file, tags=tuple(args.tag), network=args.network,
                    progress=progress, warn=_warn)
    if args.json:
        output.print_json({**rec.summary(), "seconds": round(time.perf_counter() - t0, 3)})
    else:
        print(rec.id)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    with Store.open(cfg.db_path) as store:
        recs = oci_store.list_images(store)
    if args.json:
        output.print_json([r.summary() for r in recs])
        return 0
    rows = [[", ".join(r.names) or "<none>", r.short_id, len(r.layers), output.human_bytes(r.size_bytes),
             datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M")] for r in recs]
    output.print_table(None, ["NAMES", "ID", "LAYERS", "SIZE", "STORED"], rows)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    with Store.open(cfg.db_path) as store:
        rec = oci_store.find(store, args.ref)
    info = rec.inspect()
    if args.json:
        output.print_json(info)
    else:
        for key in ("id", "names", "digests", "size_bytes", "architecture", "os"):
            print(f"{key}: {info[key]}")
        for key, value in info["config"].items():
            print(f"config.{key}: {value}")
        for i, layer in enumerate(info["layers"]):
            print(f"layer {i}: {layer}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    cfg = Config.from_env()
    removed = []
    with Store.open(cfg.db_path) as store:
        for ref in args.refs:
            removed.append(oci_store.remove(store, ref).id)
        freed = gc.free_image_layers(cfg, store)
    if args.json:
        output.print_json({"removed": removed, "freed_layers": freed})
    else:
        for image_id in removed:
            print(f"removed {image_id}")
        print(f"{len(freed)} layers freed")
    return 0
