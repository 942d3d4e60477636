"""a2a-grpc-server: an A2A (lf.a2a.v1) gRPC server whose streams always end with the outcome.

Embed it in an existing ``grpc.aio`` server with ``A2AService``, or run the
standalone ``A2AServer`` (``a2a-grpc-server serve``). Importing it leaves the
process's environment as it was (no ``OTEL_*`` default is set).

The public API is what ``__all__`` names here and in the public modules
``auth``, ``cluster``, ``testing`` and ``agents.echo`` (docs/reference/api.md).
Everything under ``_internal`` is the implementation and may change in any release.
"""

from __future__ import annotations

from ._internal.app.service import A2AServer, A2AService, grpc_options
from ._internal.app.tls import TlsFiles
from ._internal.config import ServerConfig
from ._internal.obs.logs import JsonFormatter

__all__ = [
    "A2AServer",
    "A2AService",
    "JsonFormatter",
    "ServerConfig",
    "TlsFiles",
    "grpc_options",
]
