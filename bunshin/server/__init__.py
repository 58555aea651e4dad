"""``bunshin serve``: the workspace API over HTTP (FastAPI on uvicorn), bearer-token protected."""

from .app import create_app
from .token import ensure_token

__all__ = ["create_app", "ensure_token"]
