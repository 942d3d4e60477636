"""Call metadata: the A2A version and extensions a client asked for.

``a2a-version`` and ``a2a-extensions`` arrive as gRPC metadata. An absent or
empty version means 0.3 (spec v1.0.1 §3.6); this server speaks 1.0, and
serves 0.3 clients only the RPCs whose meaning did not change.

An executor sees the call as a2a-sdk's ``ServerCallContext`` (the metadata as
``state["headers"]``, the requested extensions). That object is a pydantic
model of about 1 KB; a task parked in ``execute()`` would keep it for as long
as it waits, read or not. So a call is kept as a ``Caller`` (its text
metadata) and the ``ServerCallContext`` is built the first time the executor
asks for it (``request_context``).
"""

from __future__ import annotations

from typing import Any

import grpc
from a2a.server.agent_execution import RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.id_generator import UUIDGenerator
from a2a.utils.errors import VersionNotSupportedError

from ..errors import InvalidFieldError, quote
from .principal import Principal, PrincipalUser, current_principal
from .scope import scope_key

VERSION_KEY = "a2a-version"
EXTENSIONS_KEY = "a2a-extensions"
SERVED_VERSION = "1.0"
LEGACY_VERSION = "0.3"
MAX_TENANT_CHARS = 256
"""Longest ``tenant`` a request may name (it is stored with every task of the tenant)."""
V1_ONLY_METHODS = frozenset({"ListTasks"})
"""RPCs that did not exist in 0.3: a 0.3 client cannot mean them."""


_IDS = UUIDGenerator()
"""One stateless id generator for every RequestContext (it would make two per
request; the ids are always given, so it is never even called)."""


class Caller:
    """Who made a call: its text metadata, and the ``ServerCallContext`` made from it.

    Args:
        headers: The call's metadata, binary (``-bin``) keys left out.
        timeout: Seconds the client gives the call (its gRPC deadline), or None.
        principal: Who called (None without authentication; see ``auth``).
        tenant: The request's ``tenant``.
    """

    __slots__ = ("_context", "act_by", "headers", "principal", "scope", "tenant", "timeout")

    def __init__(
        self,
        headers: tuple[tuple[str, str], ...],
        timeout: float | None = None,
        principal: Principal | None = None,
        tenant: str = "",
    ) -> None:
        self.headers = headers
        self.timeout = timeout
        self.principal = principal
        self.tenant = tenant
        self.scope = scope_key(tenant, principal.name if principal is not None else "")
        """Whose tasks this caller may see (see ``scope``)."""
        self.act_by: float | None = None
        """A routed request's: the event loop's time after which the owner records nothing
        for it (its asker may have given up; see ``jetstream.routing``)."""
        self._context: ServerCallContext | None = None

    def header_map(self) -> dict[str, str]:
        """The metadata as a dict (a repeated key keeps its last value)."""
        return dict(self.headers)

    def extensions(self) -> set[str]:
        """The extension URIs the client asked for (``a2a-extensions``, comma-separated)."""
        found: set[str] = set()
        for key, value in self.headers:
            if key == EXTENSIONS_KEY:
                found.update(uri.strip() for uri in value.split(",") if uri.strip())
        return found

    def server_context(self) -> ServerCallContext:
        """The executor-facing call context (made once, on first use)."""
        if self._context is None:
            self._context = ServerCallContext(
                state={"headers": self.header_map()},
                requested_extensions=self.extensions(),
                tenant=self.tenant,
            )
            if self.principal is not None:
                self._context.user = PrincipalUser(self.principal)
        return self._context


def caller(
    context: grpc.aio.ServicerContext[object, object], method: str, tenant: str = ""
) -> Caller:
    """Check the client's A2A version and capture the call's metadata.

    Args:
        context: The gRPC servicer context.
        method: The RPC's name, e.g. ``SendMessage``.
        tenant: The request's ``tenant`` field.

    Raises:
        VersionNotSupportedError: The client asked for a version this server
            does not serve, or for a 1.0-only RPC as a 0.3 client.
        InvalidFieldError: ``tenant`` is longer than ``MAX_TENANT_CHARS``.
    """
    headers = tuple(
        (key, value if isinstance(value, str) else value.decode())
        for key, value in context.invocation_metadata() or ()
        if not key.endswith("-bin")
    )
    version = ""
    for key, value in headers:
        if key == VERSION_KEY:
            version = value  # a repeated key: the last one counts
    _check_version(version.strip() or LEGACY_VERSION, method)
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidFieldError("tenant", f"is longer than {MAX_TENANT_CHARS} characters")
    if not tenant.isprintable():
        raise InvalidFieldError("tenant", "contains a control character; a tenant is printable")
    return Caller(headers, context.time_remaining(), current_principal(), tenant)


def request_context(call: Caller, **kwargs: Any) -> RequestContext:
    """An a2a-sdk ``RequestContext`` whose call context is made on first use.

    Args:
        call: The caller.
        **kwargs: ``RequestContext``'s other arguments (ids always given).
    """
    return _DeferredRequestContext(
        call, task_id_generator=_IDS, context_id_generator=_IDS, **kwargs
    )


class _DeferredRequestContext(RequestContext):
    """``RequestContext`` with ``_call_context`` made from the caller when first read.

    ``RequestContext`` reads its call context only through ``_call_context``
    (``call_context``, ``tenant``, ``requested_extensions``), so this one
    attribute is all that is deferred.
    """

    def __init__(self, call: Caller, **kwargs: Any) -> None:
        self._caller = call
        super().__init__(call_context=None, **kwargs)  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def _call_context(self) -> ServerCallContext:
        return self._caller.server_context()

    @_call_context.setter
    def _call_context(self, value: ServerCallContext | None) -> None:
        if value is not None:
            self._caller._context = value


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
        f"A2A version {quote(version)} is not supported; this server speaks {SERVED_VERSION} "
        f"(send metadata '{VERSION_KEY}: {SERVED_VERSION}')"
    )
