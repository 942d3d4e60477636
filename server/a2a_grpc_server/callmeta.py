"""Call metadata: the A2A version and extensions a client asked for.

``a2a-version`` and ``a2a-extensions`` arrive as gRPC metadata. An absent or
empty version means 0.3 (spec v1.0.1 §3.6); this server speaks 1.0, and
serves 0.3 clients only the RPCs whose meaning did not change.
"""

from __future__ import annotations

import grpc
from a2a.server.context import ServerCallContext
from a2a.utils.errors import VersionNotSupportedError

VERSION_KEY = "a2a-version"
EXTENSIONS_KEY = "a2a-extensions"
SERVED_VERSION = "1.0"
LEGACY_VERSION = "0.3"
V1_ONLY_METHODS = frozenset({"ListTasks"})
"""RPCs that did not exist in 0.3: a 0.3 client cannot mean them."""


def call_context(
    context: grpc.aio.ServicerContext[object, object], method: str
) -> ServerCallContext:
    """Check the client's A2A version and build the executor-facing call context.

    Args:
        context: The gRPC servicer context.
        method: The RPC's name, e.g. ``SendMessage``.

    Returns:
        The ``ServerCallContext`` an executor sees, carrying the metadata as
        ``state["headers"]`` and the requested extensions.

    Raises:
        VersionNotSupportedError: The client asked for a version this server
            does not serve, or for a 1.0-only RPC as a 0.3 client.
    """
    headers: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if not key.endswith("-bin"):
            headers[key] = value if isinstance(value, str) else value.decode()
    version = headers.get(VERSION_KEY, "").strip() or LEGACY_VERSION
    _check_version(version, method)
    extensions = {uri.strip() for uri in headers.get(EXTENSIONS_KEY, "").split(",") if uri.strip()}
    return ServerCallContext(state={"headers": headers}, requested_extensions=extensions)


def _check_version(version: str, method: str) -> None:
    major_minor = ".".join(version.split(".")[:2])
    if major_minor in (SERVED_VERSION, "1"):
        return
    if major_minor == LEGACY_VERSION:
        if method in V1_ONLY_METHODS:
            raise VersionNotSupportedError(
                f"{method} needs A2A version {SERVED_VERSION}; send metadata "
                f"'{VERSION_KEY}: {SERVED_VERSION}' (no version means {LEGACY_VERSION})"
            )
        return
    raise VersionNotSupportedError(
        f"A2A version {version!r} is not supported; this server speaks {SERVED_VERSION} "
        f"(send metadata '{VERSION_KEY}: {SERVED_VERSION}')"
    )
