"""The image builders of the image tests (they live in ``bunshin.bench.oci_build``,
which ``bunshin bench image`` uses too)."""

from bunshin.bench.oci_build import (  # noqa: F401 (re-exported for the tests)
    Layer,
    Registry,
    binaries_layer,
    build_layout,
    busybox_base,
    compress,
    docker_archive,
    oci_archive,
    python_layer,
    skopeo,
)
