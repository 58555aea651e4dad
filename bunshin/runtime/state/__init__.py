"""What the runtime remembers: the typed records, the SQLite store, its entries and keys, the
host-wide pids budget checked in the store's transactions, and each workspace's host id range
(idranges).

May import: kernel; bunshin.errors, bunshin.config.
"""
