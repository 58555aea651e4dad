"""envd on ``bunshin serve``: what E2B's in-sandbox daemon answers on port 49983, for the
sandbox a request names (``hosts``), over the workspace's agent.

Connect RPC services ``process.Process`` (:mod:`.process`) and ``filesystem.Filesystem``
(:mod:`.filesystem`), and the HTTP routes ``/files``, ``/envs``, ``/metrics``, ``/health``
(:mod:`.files`). Every call but ``/health`` must carry the sandbox's access token
(``X-Access-Token``: ``auth.envd_access_token`` of the sandbox id); one sandbox's token
opens no other. A sandbox that is not there is answered as E2B's proxy does (502, "...
was not found"), which the SDK raises as ``SandboxNotRunningException`` (and
``is_running()`` reads as False).

:data:`ENVD_VERSION` is the envd version whose features this implements (the control
plane reports it as ``envdVersion``; the SDK picks its wire forms by it).
"""

from __future__ import annotations

#: The envd version served: octet-stream uploads (0.5.7), CloseStdin (0.5.2), the default
#: user (0.4.0), the stdin choice (0.3.0), recursive watches (0.1.4), PTYs. Not: file
#: metadata (0.6.2) nor entries in watch events (0.6.3), which the SDK asks only of newer ones.
ENVD_VERSION = "0.5.7"
