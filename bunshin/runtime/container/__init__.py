"""A workspace's container: create, start, stop and remove (lifecycle), the launcher run in the new
namespaces (init), id-mapped views of layers (idmap) and a workspace's own views of them in its id
range (range_views), the seccomp filter, cgroups and moves between them, the
state filesystem, teardown, images made ready for a workspace, and its stats.

May import: agent_host, oci, memfile, kernel, state; never criu, snapshot or upkeep.
"""
