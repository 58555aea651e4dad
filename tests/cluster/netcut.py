"""A network cut between the head and one host's server: nftables rules that drop every
TCP packet to or from the server's port on this machine (the head's connections hang,
new ones get no answer), as a partition would. The host's own side is untouched: its
actor sees its server through the kernel, not the network."""

from __future__ import annotations

import os
import subprocess
import uuid


class NetCut:
    def __init__(self, port: int) -> None:
        self.port = port
        self.table = f"bunshin_cut_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.active = False

    def cut(self) -> None:
        rules = (f"table inet {self.table} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n"
                 f"  tcp dport {self.port} drop\n  tcp sport {self.port} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True, timeout=30)
        self.active = True

    def heal(self) -> None:
        if self.active:
            subprocess.run(["nft", "delete", "table", "inet", self.table], check=True, timeout=30)
            self.active = False

    def rules(self) -> str:
        return subprocess.run(["nft", "list", "table", "inet", self.table], capture_output=True, text=True).stdout
