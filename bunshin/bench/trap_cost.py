"""``bunshin bench trap``: what one call the SIGSYS trap of converted memory intercepts costs.

A workspace runs ``trapcost.c`` (built here with gcc) holding written anonymous
memory; it is forked once, and the same timings run in the clone (where that
memory is converted: DONTNEED, every rt_sigprocmask are trapped) and in the parent
(nothing trapped), ``rounds`` times alternately. Result (``--json``): per side the
median of each timing in ns per call (``trapcost.c`` names them; each the fastest of its
batches, so that another task's preemption on a loaded host does not count), and
``trap_overhead_ns`` = clone minus parent for each.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from ..config import Config
from ..errors import HostUnsupported, InvalidArgument, RuntimeFailure
from ..workspace import Workspace

KEYS = ("dontneed_converted_ns", "dontneed_again_ns", "dontneed_fresh_anon_ns", "sigprocmask_ns", "sigprocmask_read_ns",
        "getpid_ns")
_WAIT = 'while [ ! -e "$1" ]; do sleep 0.01; done; cat "$1"'


def _build(out: Path) -> None:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise HostUnsupported("bench trap needs gcc", hint="install gcc (make install does)")
    src = out.with_suffix(".c")
    src.write_bytes(resources.files(__package__).joinpath("trapcost.c").read_bytes())
    subprocess.run([gcc, "-O2", "-o", str(out), str(src)], check=True, capture_output=True)


def _ask(ws: Workspace) -> dict[str, Any]:
    r = ws.exec(["sh", "-c", "rm -f /tmp/trapcost.out; : > /tmp/trapcost.req; " + _WAIT, "sh",
                 "/tmp/trapcost.out"], timeout=120)
    if r.exit_code != 0:
        raise RuntimeFailure(f"trapcost in {ws.id} did not answer: {r.stderr[-300:]}", hint="see the workspace")
    out: dict[str, Any] = json.loads(r.stdout)
    if "error" in out:
        raise RuntimeFailure(f"trapcost: {out['error']}", hint="use fewer --rounds")
    return out


def run(cfg: Config, *, rounds: int = 5, mib: int = 64) -> dict[str, Any]:
    if rounds < 1 or mib < 8:
        raise InvalidArgument("rounds must be >= 1 and the memory >= 8 MiB", hint="e.g. --rounds 5 --mib 64")
    with tempfile.TemporaryDirectory(prefix="bunshin-trapcost-") as tmp:
        binary = Path(tmp) / "trapcost"
        _build(binary)
        parent = Workspace.create("host", config=cfg, memory="1G")
        try:
            parent.files.write("/root/trapcost", binary.read_bytes(), mode=0o755)
            parent.commands.spawn(["/root/trapcost", str(mib)])
            parent.exec(["sh", "-c", _WAIT, "sh", "/tmp/trapcost.ready"], timeout=60)
            (clone,) = parent.fork(1)
            try:
                sides: dict[str, list[dict[str, Any]]] = {"clone": [], "parent": []}
                for _ in range(rounds):
                    sides["clone"].append(_ask(clone))
                    sides["parent"].append(_ask(parent))
            finally:
                clone.remove()
        finally:
            parent.remove()
    result: dict[str, Any] = {"rounds": rounds, "calls_per_round": sides["clone"][0]["calls"]}
    for side, runs in sides.items():
        result[side] = {k: round(statistics.median(r[k] for r in runs)) for k in KEYS}
    result["trap_overhead_ns"] = {k: result["clone"][k] - result["parent"][k] for k in KEYS}
    return result
