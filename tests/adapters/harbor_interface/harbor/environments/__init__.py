"""A stand-in for Harbor's package layout (see ../README.md)."""
