"""Keeping a home healthy: garbage collection of what dead workspaces and snapshots left (gc,
cluster leases) and ``bunshin doctor``'s checks.

May import: every other room of the runtime.
"""
