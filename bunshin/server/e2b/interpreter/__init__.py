"""E2B's code interpreter (``e2b_code_interpreter.Sandbox.run_code`` and its contexts) on
bunshin: stateful Python per context, run by the image's ``python3`` inside the sandbox's
workspace (``bunshin/agent/pyrepl.py``, the ``python`` tool's interpreter), so forks and
snapshots carry every context's globals.

Served on port 49999 of a sandbox (:data:`app.PORT`): :func:`make_interpreter_app`."""

from .app import PORT, make_interpreter_app

__all__ = ["PORT", "make_interpreter_app"]
