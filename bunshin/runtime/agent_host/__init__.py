"""The host side of the in-workspace agent: the bundle it runs from (a copy of the interpreter and
bunshin.agent), the client that talks to its socket, the records it answers with, and trimming
its memory before a dump.

May import: kernel, state; bunshin.agent (its wire format), bunshin.errors, bunshin.config.
"""
