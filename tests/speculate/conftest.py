from tests.cache.conftest import real_root  # noqa: F401  (the same real task root)
