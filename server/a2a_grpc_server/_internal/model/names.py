"""Names and bounds every layer shares."""

from __future__ import annotations

A2A_SERVICE = "lf.a2a.v1.A2AService"
"""The gRPC service this server implements."""
TASK_PREFIX = "a2a-grpc-server"
"""Every asyncio task this package creates is named with this prefix."""
MAX_ID_CHARS = 256
"""Longest id (task, context, message, push config) a request may carry; the server's own are 36."""
MAX_TOKEN_CHARS = 1024
"""Longest page token or push token; the server's own are far shorter."""
