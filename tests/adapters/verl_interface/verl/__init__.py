"""A stand-in for verl's package layout (see ../README.md)."""
