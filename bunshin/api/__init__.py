"""The HTTP API's typed requests and responses, shared by ``bunshin.server`` and ``bunshin.client``."""
