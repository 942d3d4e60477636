"""``python -m a2a_grpc_server.cli``: the command line (see ``_internal.app.cli``)."""

from __future__ import annotations

from ._internal.app.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
