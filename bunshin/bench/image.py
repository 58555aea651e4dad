"""``bunshin bench image``: OCI images side by side with the host image.

Two images are built (once, cached under ``Config.paths.bench``): ``base`` (~300 MB:
busybox-static, Debian's python3, and host folders as a layer of data, the size of
a SWE-style environment) and ``derived`` (the same layers plus one small layer,
another config), pushed to Debian's docker-registry on loopback. In a private home
(removed at the end) the bench then measures:

- pull + unpack of ``base``: cold (empty store) and warm (stored: skopeo still
  fetches the blobs, nothing is unpacked);
- storage: ``derived`` pulled next to ``base``, its shared layers stored once
  (bytes on disk against the two images' sizes added up);
- create: a workspace from the image against one from the host image (p50 of a
  few, each to its first exec answered);
- fork: a workspace of each kind holding the fork bench's heap program (Python
  inside: the image's own python3 on the image), forked ``clones`` ways (copy-on-
  write): restore p50, private memory per clone, system-wide memory added.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.progress import Progress

from .. import console as output
from ..config import Config
from ..errors import HostUnsupported, RuntimeFailure
from ..runtime.container import statefs
from ..runtime.oci import pull as oci_pull
from ..runtime.oci import store as oci_store
from ..runtime.state.store import Store
from ..runtime.upkeep import gc
from ..workspace import Workspace
from . import oci_build as ob
from .fork import HEAP_PROG, measure
from .stats import percentile

BUILD_FORMAT = "2"
DATA_DIRS = ("/usr/share/locale", "/usr/lib/gcc", "/usr/share/doc")  # as many as fit TARGET_BYTES
TARGET_BYTES = 280 << 20  # the data layer: host folders up to this size


def _data_layer() -> ob.Layer:
    layer = ob.Layer()
    layer.add("data", "dir", None, 0o755)
    total = 0
    for d in DATA_DIRS:
        if not Path(d).is_dir():
            continue
        size = sum(f.lstat().st_size for f in Path(d).rglob("*") if f.is_file() and not f.is_symlink())
        if total + size > TARGET_BYTES and total:
            continue
        layer.add(f"data/{Path(d).name}", "host", d)
        total += size
    return layer


def build_images(root: Path) -> dict[str, Path]:
    """The two bench layouts under ``root`` (built unless there)."""
    out = {"base": root / f"base-{BUILD_FORMAT}", "derived": root / f"derived-{BUILD_FORMAT}"}
    if all((p / "index.json").is_file() for p in out.values()):
        return out
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    layers = [ob.busybox_base(), ob.python_layer(), _data_layer()]
    ob.build_layout(out["base"], layers, config={"Env": ["BENCH=base"]})
    extra = ob.Layer().add("task", "dir").add("task/README", "file", "a task on top of the shared base\n")
    ob.build_layout(out["derived"], [*layers, extra], config={"Env": ["BENCH=derived"], "WorkingDir": "/task"})
    return out


def _du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=False).stdout
    return int(out.split()[0]) if out.strip() else 0


def _heap_workspace(cfg: Config, image: str, heap_mib: int) -> Workspace:
    ws = Workspace.create(image, memory=f"{heap_mib + 768}M", pids=256, config=cfg)
    try:
        ws.files.write("/root/heap.py", HEAP_PROG)
        ws.commands.spawn(["python3", "/root/heap.py", str(heap_mib)])
        r = ws.exec(["sh", "-c", "while [ ! -s /tmp/heap.ready ]; do sleep 0.02; done"], timeout=300)
        if r.exit_code != 0:
            raise RuntimeFailure(f"the heap program did not start in {image}: {r.stdout!s}{r.stderr!s}")
    except BaseException:
        ws.remove()
        raise
    return ws


def _creates(cfg: Config, image: str, count: int) -> dict[str, Any]:
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        with Workspace.create(image, memory="256M", config=cfg) as ws:
            ws.exec("true", timeout=30)
            times.append((time.perf_counter() - t0) * 1000)
    return {"create_ms_p50": round(percentile(times, 50), 1), "create_ms": [round(t, 1) for t in times]}


def run(cfg: Config, *, clones: int = 64, heap_mib: int = 64, creates: int = 5) -> dict[str, Any]:
    """Measure; the result as a dict (``--json``)."""
    for tool in ("skopeo", "docker-registry"):
        if shutil.which(tool) is None:
            raise HostUnsupported(f"{tool} is not installed", hint="run `make install`")
    layouts = build_images(cfg.paths.bench / "image")
    work = Path(tempfile.mkdtemp(prefix="bench-image-", dir=cfg.paths.bench))
    bench_cfg = Config.for_home(work / "home", criu=cfg.criu)
    r: dict[str, Any] = {"clones": clones, "heap_mib": heap_mib}
    try:
        (work / "registry").mkdir()
        with ob.Registry(work / "registry") as reg, Store.open(bench_cfg.db_path) as store, Progress(
                transient=True, console=output.err) as progress:
            task = progress.add_task("pushing the bench images to a loopback registry", total=None)
            base_ref = reg.push(layouts["base"], "bench/base:1")
            derived_ref = reg.push(layouts["derived"], "bench/derived:1")
            progress.update(task, description="pull + unpack (cold)")
            t0 = time.perf_counter()
            base = oci_pull.pull(bench_cfg, store, base_ref)
            cold = time.perf_counter() - t0
            progress.update(task, description="pull (warm)")
            t0 = time.perf_counter()
            oci_pull.pull(bench_cfg, store, base_ref)
            warm = time.perf_counter() - t0
            r["pull"] = {"image_bytes": base.size_bytes, "layers": len(base.layers), "cold_s": round(cold, 2),
                         "warm_s": round(warm, 2), "cold_mb_per_s": round(base.size_bytes / 1e6 / cold, 1)}
            progress.update(task, description="storage of two images sharing a base")
            derived = oci_pull.pull(bench_cfg, store, derived_ref)
            stored = _du(bench_cfg.paths.image_layers)
            r["storage"] = {"base_bytes": base.size_bytes, "derived_bytes": derived.size_bytes,
                            "images_added_up_bytes": base.size_bytes + derived.size_bytes,
                            "stored_bytes": stored, "shared_layers": len(set(base.layers) & set(derived.layers))}
            progress.update(task, description="create: image against host")
            r["create"] = {"image": _creates(bench_cfg, base_ref, creates), "host": _creates(bench_cfg, "host", creates)}
            r["fork"] = {}
            for kind, image in (("image", base_ref), ("host", "host")):
                progress.update(task, description=f"fork x{clones}: {kind}")
                parent = _heap_workspace(bench_cfg, image, heap_mib)
                try:
                    m = measure(parent, clones, "cow", progress)
                finally:
                    parent.remove()
                r["fork"][kind] = {k: m[k] for k in ("restore_ms_p50", "restore_ms_p99", "parent_pause_ms",
                                                     "private_bytes_per_clone", "total_added_bytes",
                                                     "clones_added_bytes")}
            progress.remove_task(task)
    finally:
        with Store.open(bench_cfg.db_path) as store:
            for rec in oci_store.list_images(store):
                oci_store.remove(store, rec.id)
            gc.collect(bench_cfg, store, release=True)
        statefs.release(bench_cfg)
        shutil.rmtree(work, ignore_errors=True)
        if not os.path.ismount(bench_cfg.tmpfs):
            shutil.rmtree(bench_cfg.tmpfs, ignore_errors=True)
    return r


def print_report(r: dict[str, Any]) -> None:
    p, s, c, f = r["pull"], r["storage"], r["create"], r["fork"]
    mb = 1e6
    output.print_table("pull + unpack", ["image", "layers", "cold", "warm", "cold rate"],
                       [[f"{p['image_bytes'] / mb:.0f} MB", p["layers"], f"{p['cold_s']} s", f"{p['warm_s']} s",
                         f"{p['cold_mb_per_s']} MB/s"]])
    output.print_table("two images sharing a base", ["base", "derived", "added up", "stored", "shared layers"],
                       [[f"{s['base_bytes'] / mb:.0f} MB", f"{s['derived_bytes'] / mb:.0f} MB",
                         f"{s['images_added_up_bytes'] / mb:.0f} MB", f"{s['stored_bytes'] / mb:.0f} MB",
                         s["shared_layers"]]])
    output.print_table(f"create (p50 of {len(c['image']['create_ms'])}) and fork x{r['clones']} "
                       f"({r['heap_mib']} MiB heap)",
                       ["base", "create", "restore p50", "restore p99", "pause", "private/clone", "added"],
                       [[k, f"{c[k]['create_ms_p50']} ms", f"{f[k]['restore_ms_p50']} ms",
                         f"{f[k]['restore_ms_p99']} ms", f"{f[k]['parent_pause_ms']} ms",
                         output.human_bytes(f[k]["private_bytes_per_clone"]),
                         output.human_bytes(f[k]["total_added_bytes"])] for k in ("image", "host")])
