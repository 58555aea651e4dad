"""A workspace's network beyond loopback (``docs/guides/network.md``): its mode and policy
(policy), its address out of a private pool (slots), its veth pair and nftables table
(egress) made through rtnetlink (rtnl) and libnftables (nft).

May import: kernel, state; bunshin.errors, bunshin.config.
"""
