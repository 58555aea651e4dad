"""OCI and Docker images: a content-addressed layer store and what fills it.

``refs``: image references. ``records``: the image config and the stored image.
``unpack``: one layer tar into a store folder, safely. ``sources``: OCI layouts, OCI
archives and ``docker save`` archives read as manifests, configs and layer blobs.
``store``: load, list, find, remove and free images and layers. ``pull``: registries,
through skopeo. Transport is skopeo's; only the unpacking into the store is bunshin's.
"""
