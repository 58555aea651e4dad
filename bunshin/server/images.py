"""The images a remote caller may name: ``host`` or a stored (or pullable) image, never a folder.

A host folder as a root filesystem is a local choice of whoever runs bunshin on the host;
over HTTP a name that could be a folder (``/x``, ``./x``, or one that is not a reference)
is refused, and a reference is turned into the stored image's id (``sha256:...``) before
anything uses it, so no folder of the server's, relative to wherever it runs, can stand in.
"""

from __future__ import annotations

from ..api.models import served_image
from ..config import Config
from ..errors import InvalidArgument
from ..runtime import images
from ..runtime.store import Store

HINT = "'host', or an image reference the host holds or can pull (`bunshin image ls` on the host)"


def check_image(image: str, field: str = "image") -> None:
    """Refuse what is not 'host' or an image reference (``InvalidArgument`` naming ``field``)."""
    try:
        served_image(image)
    except ValueError as e:
        raise InvalidArgument(f"{field}: {e}", field=field, hint=HINT) from None


def image_id(config: Config, image: str, field: str = "image") -> str:
    """'host', or the id of the stored image ``image`` names (pulled first if the store lacks it
    and the reference names its registry)."""
    check_image(image, field)
    if image == images.HOST:
        return image
    with Store.open(config.db_path) as store:
        return images.stored_image(config, store, image).id
