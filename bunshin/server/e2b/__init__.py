"""E2B's API on ``bunshin serve``: the control plane (REST, ``X-API-Key``), envd (Connect
RPC, chosen by ``E2b-Sandbox-Id`` or by host name ``<port>-<sandbox id>.<domain>``) and the
code interpreter, so the unmodified ``e2b`` SDKs reach bunshin by changing one URL.

An E2B sandbox id is the bunshin workspace id, verbatim."""
