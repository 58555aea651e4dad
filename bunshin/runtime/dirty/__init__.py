"""Dirty-page tracking of a live process without soft-dirty: see ``tracker``."""

from .kernel import Run
from .tracker import Area, Tracker, TrackingUnavailable

__all__ = ["Area", "Run", "Tracker", "TrackingUnavailable"]
