"""Quickstart (as root: `python examples/quickstart.py`): create a workspace, run a command,
fork it 4 ways, let the forks diverge, remove them all."""

from bunshin import Workspace, remove_all

with Workspace.create("host", memory="512M") as ws:  # removed when the block ends
    ws.exec("mkdir -p /work && echo started > /work/log")
    forks = ws.fork(4)  # 4 live copy-on-write clones of this instant, processes and files
    try:
        print(f"4 forks; the parent paused {forks.timings.pause_ms:.0f} ms")
        for i, fork in enumerate(forks):
            fork.exec(f"echo fork {i} >> /work/log")  # each one goes its own way
        for fork in forks:
            print(fork.id, fork.exec("tail -n 1 /work/log").stdout.strip())
        print("parent:", ws.exec("cat /work/log").stdout.strip())  # untouched: started
    finally:
        remove_all(forks)
