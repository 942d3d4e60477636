"""Authentication: who is calling, decided before any work, by a gRPC server interceptor.

``AuthInterceptor(authenticator)`` guards the A2A service (health and
reflection stay open): each call's metadata goes to the ``Authenticator``,
which returns the caller's ``Principal`` or raises ``AuthenticationError``;
a refused call answers UNAUTHENTICATED with ErrorInfo and runs nothing. The
principal travels with the call (``current_principal``), and the executor
sees it as a2a-sdk expects: ``context.call_context.user`` (``user_name``,
``is_authenticated``).

Built in: ``TokenFile`` (``serve --auth-tokens FILE``), static bearer tokens,
one ``principal:token`` per line, compared in constant time, the file re-read
when it changes (a revoked token stops working at once); ``ClientCertificate``
(``--auth-mtls``), the client certificate's SPIFFE ID or common name; and
``TrustedHeader`` (``--auth-trusted-header NAME``), a header a mesh sidecar set
after authenticating the caller; and ``jwtauth.JwtAuthenticator``
(``--auth-jwt-*``), JWTs verified against a JWKS. Embedders write their own ``Authenticator``
(one method) and add the interceptor to their server.

Who runs what: ``authenticate`` runs on the event loop at the start of every
call, before the RPC's own code (the interceptor wraps each A2A handler);
``TokenFile`` re-reads its file there when its modification time or size
changed (one ``stat`` per call).
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from a2a.types.a2a_pb2 import HTTPAuthSecurityScheme, MutualTlsSecurityScheme, SecurityScheme

from .. import errors
from ..errors import (  # re-exported: the error tree lives in errors
    AuthenticationError as AuthenticationError,
)
from ..errors import UnguardableHandlerError
from ..model.names import A2A_SERVICE
from ..model.principal import (
    MAX_PRINCIPAL_CHARS,
    Principal,
    PrincipalUser,
    current_principal,
    serving_as,
)
from .intercept import Behavior, WrappingInterceptor

__all__ = [  # (Principal and its helpers live in model.principal; these are re-exported)
    "MAX_PRINCIPAL_CHARS",
    "AuthInterceptor",
    "AuthenticationError",
    "Authenticator",
    "ClientCertificate",
    "Credentials",
    "Principal",
    "PrincipalUser",
    "TokenFile",
    "TrustedHeader",
    "current_principal",
    "declared_scheme",
]

logger = logging.getLogger(__name__)

SERVICE = A2A_SERVICE


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a call shows of its caller.

    Attributes:
        metadata: The call's text metadata (keys lower-case).
        peer: gRPC's auth context of the connection (e.g. ``x509_common_name``,
            ``x509_subject_alternative_name``; empty for plaintext).
    """

    metadata: Mapping[str, str]
    peer: Mapping[str, Iterable[bytes]]


class Authenticator(Protocol):
    """Turns what a call shows into its principal."""

    def authenticate(self, credentials: Credentials) -> Principal | Awaitable[Principal]:
        """The caller's principal (or an awaitable of it, for one that does I/O).

        Raises:
            AuthenticationError: Saying what is missing or wrong (never the secret).
        """
        ...


BEARER = SecurityScheme(http_auth_security_scheme=HTTPAuthSecurityScheme(scheme="Bearer"))
MTLS = SecurityScheme(
    mtls_security_scheme=MutualTlsSecurityScheme(
        description="a client certificate signed by the server's client CA"
    )
)


def declared_scheme(authenticator: Authenticator) -> tuple[str, SecurityScheme]:
    """How the agent card names what ``authenticator`` checks.

    An authenticator may say so itself with a ``card_scheme()`` method
    returning (name, ``SecurityScheme``); one that does not is taken to check
    bearer tokens.
    """
    declare = getattr(authenticator, "card_scheme", None)
    if callable(declare):
        name, scheme = declare()
        return str(name), scheme
    return "bearer", BEARER


class TokenFile:
    """Static bearer tokens from a file (see the module docstring).

    Args:
        path: The file: ``principal:token`` per line; ``#`` starts a comment.

    Raises:
        ValueError: The file is missing or holds a malformed line (saying which).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self._tokens: list[tuple[bytes, Principal]] = []
        self._load()

    def authenticate(self, credentials: Credentials) -> Principal:
        """The principal whose token the call's ``authorization: Bearer`` carries."""
        header = credentials.metadata.get("authorization", "")
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthenticationError(
                "this server requires a bearer token: send metadata 'authorization: Bearer <token>'"
            )
        self._reload()
        given = token.strip().encode()
        found: Principal | None = None
        for known, principal in self._tokens:  # every one compared: no early exit
            if hmac.compare_digest(given, known) and found is None:
                found = principal
        if found is None:
            raise AuthenticationError("the bearer token is not valid (unknown or revoked)")
        return found

    def card_scheme(self) -> tuple[str, SecurityScheme]:
        """Bearer tokens (see ``declared_scheme``)."""
        return "bearer", BEARER

    def _reload(self) -> None:
        try:
            status = self._path.stat()
        except OSError as exc:
            logger.error("tokens file %s cannot be read (%s); keeping the last", self._path, exc)
            return
        if (status.st_mtime_ns, status.st_size) != self._stamp:
            try:
                self._load()
                logger.info("tokens file %s re-read: %d tokens", self._path, len(self._tokens))
            except ValueError as exc:
                logger.error("tokens file %s not re-read: %s; keeping the last", self._path, exc)

    def _load(self) -> None:
        path = self._path
        try:
            status = path.stat()
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"tokens file {path} cannot be read: {exc}") from exc
        tokens: list[tuple[bytes, Principal]] = []
        for number, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, colon, token = line.partition(":")
            if not colon or not name.strip() or not token.strip():
                raise ValueError(f"{path}:{number}: expected 'principal:token'")
            tokens.append((token.strip().encode(), Principal(name.strip())))
        self._tokens = tokens
        self._stamp = (status.st_mtime_ns, status.st_size)


class ClientCertificate:
    """The principal is the client certificate's identity (``serve --auth-mtls``, with mTLS).

    Its SPIFFE ID (a ``spiffe://`` URI SAN) if it has one, else its subject's
    common name. The TLS handshake already proved the certificate is signed by
    the client CA.
    """

    def authenticate(self, credentials: Credentials) -> Principal:
        """The certificate's SPIFFE ID or common name."""
        peer = credentials.peer
        for san in peer.get("x509_subject_alternative_name", ()):
            text = san.decode(errors="replace")
            if text.startswith("spiffe://"):
                return Principal(text)
        for name in peer.get("x509_common_name", ()):
            if name:
                return Principal(name.decode(errors="replace"))
        raise AuthenticationError(
            "this server identifies callers by their client certificate: connect with one "
            "(mTLS) that has a SPIFFE ID or a common name"
        )

    def card_scheme(self) -> tuple[str, SecurityScheme]:
        """Mutual TLS (see ``declared_scheme``)."""
        return "mtls", MTLS


class TrustedHeader:
    """The principal is a header's value, set by a proxy that authenticated the caller.

    Only for servers reachable through that proxy alone (a mesh sidecar):
    anyone who can reach the server directly can claim any principal.

    Args:
        name: The metadata key (``serve --auth-trusted-header NAME``).
    """

    def __init__(self, name: str) -> None:
        self._name = name.lower()

    def authenticate(self, credentials: Credentials) -> Principal:
        """The header's value."""
        value = credentials.metadata.get(self._name, "").strip()
        if not value:
            raise AuthenticationError(f"metadata {self._name!r} (set by the proxy) is missing")
        return Principal(value)

    def card_scheme(self) -> tuple[str, SecurityScheme]:
        """The mesh's mutual TLS, which the proxy checks (see ``declared_scheme``)."""
        mesh = MutualTlsSecurityScheme(
            description="authenticated by the service mesh in front of this server"
        )
        return "mesh", SecurityScheme(mtls_security_scheme=mesh)


class AuthInterceptor(WrappingInterceptor):
    """Authenticates every call to the A2A service (see the module docstring).

    Args:
        authenticator: Who the caller is.
        also: Other services to guard the same way (the admin services).
    """

    def __init__(self, authenticator: Authenticator, also: tuple[str, ...] = ()) -> None:
        self._authenticator = authenticator
        self._guarded = tuple(f"/{service}/" for service in (SERVICE, *also))
        super().__init__(
            lambda method, kind, behavior: self._authenticated(behavior), on_sync=_unguardable
        )

    def covers(self, method: str) -> bool:
        """The guarded services' methods (health and reflection stay open)."""
        return method.startswith(self._guarded)

    def _authenticated(self, behavior: Behavior) -> Behavior:
        """``behavior``, run as the caller's principal once the authenticator named it."""
        authenticator = self._authenticator

        async def run(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            metadata = {
                key.lower(): value
                for key, value in context.invocation_metadata() or ()
                if isinstance(value, str)
            }
            try:
                named = authenticator.authenticate(Credentials(metadata, context.auth_context()))
                principal = await named if inspect.isawaitable(named) else named
                if not principal.name or len(principal.name) > MAX_PRINCIPAL_CHARS:
                    raise AuthenticationError(
                        f"the credentials name a principal of {len(principal.name)} characters; "
                        f"this server takes 1 to {MAX_PRINCIPAL_CHARS}"
                    )
            except AuthenticationError as exc:
                await errors.abort(context, exc)
            with serving_as(principal):
                return await behavior(request, context)

        return run


async def _unguardable(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """A synchronous handler of a guarded service: refused (authentication runs on the loop)."""
    await errors.abort(context, UnguardableHandlerError())
