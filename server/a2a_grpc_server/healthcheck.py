"""``python -m a2a_grpc_server.healthcheck``: the health probe.

See ``_internal.app.healthcheck``.
"""

from __future__ import annotations

from ._internal.app.healthcheck import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
