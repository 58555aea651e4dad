"""Workload (a): a data-analysis agent.

Setup loads a few hundred MB into the persistent ``python`` interpreter (four 8-bit
columns of a synthetic sales table, ``rows`` rows each, plus a 200k-row stores table
parsed from CSV into dicts) and records the answer to the task's question. Trajectories
are Python cells: look at the data, compute the answer (two correct ways, two subtly
wrong ones), write it to ``/work/answer.txt``. The reward is 1 for the right region
and total, 0.5 for the right region only, else 0.
"""

from __future__ import annotations

import random

from ...rollout.policies import Trace
from ...rollout.task import TaskSpec, parse_task
from ...tools import Step, ToolCall
from .common import think

MAKE_STORES = r'''
import csv, random, sys
rng = random.Random(int(sys.argv[1]))
with open("/data/stores.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["store", "city", "sqft", "opened"])
    for i in range(200_000):
        w.writerow([i, "city-%d" % rng.randrange(300), rng.randrange(800, 6000), 1990 + rng.randrange(35)])
'''

LOAD = r'''
import collections, csv, json, random
rng = random.Random({seed})
N, M, P, D0, W = {rows}, {sample}, {product}, {day0}, {width}
def column(mod):
    table = bytes(i % mod for i in range(256))
    return rng.randbytes(N).translate(table)
region, product, units, day = column(8), column(100), column(20), column(250)
with open("/data/stores.csv", newline="") as f:
    stores = list(csv.DictReader(f))
truth = collections.Counter()
for r, p, u, d in zip(region[:M], product[:M], units[:M], day[:M]):
    if p == P and D0 <= d < D0 + W:
        truth[r] += u + 1
best = max(sorted(truth), key=truth.get)
with open("/opt/da/truth.json", "w") as f:
    json.dump({{"region": best, "units": truth[best]}}, f)
del truth, best
print(len(region), len(stores))
'''

CHECK = r'''
import json
truth = json.load(open("/opt/da/truth.json"))
try:
    got = open("/work/answer.txt").read().split()
    region, units = int(got[0]), int(got[1])
except (OSError, ValueError, IndexError):
    print(0.0)
else:
    print(1.0 if (region, units) == (truth["region"], truth["units"]) else 0.5 if region == truth["region"] else 0.0)
'''

EXPLORE_FIRST = "len(region), len(stores), stores[0]"
EXPLORE_DATA = [
    "collections.Counter(product[:1_000_000]).most_common(5)",
    "sorted(set(day[:200_000]))[:10], max(units[:200_000]) + 1",
]
EXPLORE_STORES = [
    "sum(1 for s in stores if int(s['sqft']) > 3000)",
    "collections.Counter(s['city'] for s in stores).most_common(3)",
]
COMPUTE = {  # name: (code, correct?)
    "loop": ("""tot = collections.Counter()
for r, p, u, d in zip(region[:M], product[:M], units[:M], day[:M]):
    if p == P and D0 <= d < D0 + W:
        tot[r] += u + 1
best = max(sorted(tot), key=tot.get)
ans = (best, tot[best])
ans""", True),
    "index": ("""idx, i = [], product.find(P, 0, M)
while i != -1:
    idx.append(i)
    i = product.find(P, i + 1, M)
tot = collections.Counter()
for i in idx:
    if D0 <= day[i] < D0 + W:
        tot[region[i]] += units[i] + 1
best = max(sorted(tot), key=tot.get)
ans = (best, tot[best])
ans""", True),
    "inclusive": ("""tot = collections.Counter()
for r, p, u, d in zip(region[:M], product[:M], units[:M], day[:M]):
    if p == P and D0 <= d <= D0 + W:
        tot[r] += u + 1
best = max(sorted(tot), key=tot.get)
ans = (best, tot[best])
ans""", False),
    "raw-units": ("""tot = collections.Counter()
for r, p, u, d in zip(region[:M], product[:M], units[:M], day[:M]):
    if p == P and D0 <= d < D0 + W:
        tot[r] += u
best = max(sorted(tot), key=tot.get)
ans = (best, tot[best])
ans""", False),
}
WRITE = "open('/work/answer.txt', 'w').write('%d %d' % ans)"


def task(i: int, *, rows: int, seed: int) -> TaskSpec:
    rng = random.Random(seed * 1000 + i)
    product, day0, width = rng.randrange(100), rng.randrange(0, 200), rng.choice([20, 30, 50])
    return parse_task({
        "id": f"data-{i}",
        "memory": "2G",
        "files": {"/opt/da/make_stores.py": MAKE_STORES, "/opt/da/check.py": CHECK},
        "setup": [
            f"mkdir -p /data /work && python3 /opt/da/make_stores.py {seed + i}",
            {"tool": "python", "arguments": {"code": LOAD.format(
                seed=seed + i, rows=rows, sample=2_000_000, product=product, day0=day0, width=width)}},
        ],
        "tools": ["python", "bash"],
        "workdir": "/work",
        "system": "You are a data analyst with a persistent Python session. The sales table is loaded as "
                  "columns region, product, units (0-based: add 1), day; stores is a list of dicts.",
        "prompt": f"In the first 2,000,000 sales rows, which region sold the most units of product {product} "
                  f"on days {day0} to {day0 + width - 1}? Write 'REGION UNITS' to /work/answer.txt.",
        "max_turns": 12,
        "reward": "python3 /opt/da/check.py",
        "call_timeout": 120,
        "trajectory_timeout": 900,
        "metadata": {"workload": "data-analysis"},
    })


def traces(t: TaskSpec, n: int, *, seed: int, think_scale: float) -> list[Trace]:
    """``n`` attempts at ``t``: shared first looks, then branching approaches (some wrong)."""
    out = []
    for j in range(n):
        rng = random.Random(f"{seed}:{t.id}:{j}")
        cells = [EXPLORE_FIRST, rng.choice(EXPLORE_DATA)]
        if rng.random() < 0.5:
            cells.append(rng.choice(EXPLORE_STORES))
        approach = rng.choices(list(COMPUTE), weights=[4, 2, 1, 1])[0]
        cells.append(COMPUTE[approach][0])
        if rng.random() < 0.3:
            cells.append("ans, sum(tot.values())")
        cells.append(WRITE)
        steps = tuple(Step(i + 1, think(rng, think_scale), ToolCall("python", {"code": c})) for i, c in enumerate(cells))
        out.append(Trace(f"{t.id}-trace-{j}", steps, task=t.id, final_content=f"done ({approach})",
                         final_think_s=think(rng, think_scale) / 2))
    return out
