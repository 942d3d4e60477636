"""a2a-grpc-server: an A2A (lf.a2a.v1) gRPC server whose streams always end with the outcome.

Embed it in an existing ``grpc.aio`` server with ``A2AService``, or run the
standalone ``A2AServer`` (``a2a-grpc-server serve``).
"""

from __future__ import annotations

import os

# a2a-sdk's OpenTelemetry decorators make a span per enqueued event (thousands per
# streamed LLM answer); this server traces per RPC and per run instead (see
# ``tracing``). Off unless asked for: OTEL_INSTRUMENTATION_A2A_SDK_ENABLED=true.
# (Read by a2a-sdk when first imported: an application that imported it earlier
# keeps what it had.)
os.environ.setdefault("OTEL_INSTRUMENTATION_A2A_SDK_ENABLED", "false")

from .app.service import A2AServer, A2AService, grpc_options
from .config import ServerConfig

__all__ = ["A2AServer", "A2AService", "ServerConfig", "grpc_options"]
