"""Test doubles that satisfy bunshin's protocols: public, documented, checked against them.

``FakeWorld().create()`` gives an in-memory workspace (files, sessions, a tiny shell,
fork and snapshot) for testing code above the runtime without root or containers.
"""

from .fake import FakeSnapshot, FakeState, FakeWorkspace, FakeWorld

__all__ = ["FakeSnapshot", "FakeState", "FakeWorkspace", "FakeWorld"]
