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
when it changes (a revoked token stops working at once; a file that goes
missing or stops parsing revokes them all); ``ClientCertificate``
(``--auth-mtls``), the client certificate's SPIFFE ID (from its one
``spiffe://`` URI SAN) or common name; and ``TrustedHeader``
(``--auth-trusted-header NAME``), a header a mesh sidecar set after
authenticating the caller; and ``jwtauth.JwtAuthenticator``
(``--auth-jwt-*``), JWTs verified against a JWKS. Embedders write their own ``Authenticator``
(one method) and add the interceptor to their server.

Credentials are read exactly: a header the authenticator reads that comes
twice is refused (whoever could add the second value would choose the
principal), and a principal name must be 1 to ``MAX_PRINCIPAL_CHARS``
printable characters (no control characters: names reach logs and headers).

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
    principal_problem,
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

logger = logging.getLogger(__name__.replace("._internal", ""))

SERVICE = A2A_SERVICE
SPIFFE = "spiffe://"


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a call shows of its caller.

    Attributes:
        metadata: The call's text metadata (keys lower-case; the last value of
            a key given more than once).
        peer: gRPC's auth context of the connection (e.g. ``x509_common_name``,
            ``peer_uri``: the URI SANs; empty for plaintext).
        repeated: Keys of ``metadata`` the call gave more than once.
    """

    metadata: Mapping[str, str]
    peer: Mapping[str, Iterable[bytes]]
    repeated: frozenset[str] = frozenset()

    def single(self, key: str) -> str:
        """The value of metadata ``key`` ("" if absent).

        Raises:
            AuthenticationError: The call gave ``key`` more than once.
        """
        if key in self.repeated:
            raise AuthenticationError(f"metadata {key!r} was sent more than once; send it once")
        return self.metadata.get(key, "")


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

    The file holds one ``principal:token`` per line; blank lines and lines
    whose first non-blank character is ``#`` are skipped. The token is
    everything after the first colon, exactly (``#`` included; only the
    line's surrounding blanks are dropped). A token on two lines is refused,
    naming both.

    Fail closed: when the file goes missing, cannot be read or holds a
    malformed line, every token is revoked (one ERROR line per change, and
    ``reload_failures`` counts it: ``a2a_auth_reload_failures_total``) until
    the file reads well again.

    Args:
        path: The file.

    Raises:
        ValueError: At start, the file is missing or holds a malformed line
            (saying which).
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._stamp: tuple[int, int] | None = None
        self._tokens: list[tuple[bytes, Principal]] = []
        self._problem: str | None = None
        self.reload_failures = 0
        """Re-reads that failed (each revoked every token until the next good one)."""
        self._load()

    @property
    def credentials(self) -> int:
        """Tokens held now (0 while the file does not read well)."""
        return len(self._tokens)

    def authenticate(self, credentials: Credentials) -> Principal:
        """The principal whose token the call's ``authorization: Bearer`` carries."""
        header = credentials.single("authorization")
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
            self._fail(f"cannot be read ({exc})", None)
            return
        stamp = (status.st_mtime_ns, status.st_size)
        if stamp != self._stamp:
            try:
                self._load()
            except ValueError as exc:
                self._fail(str(exc), stamp)
                return
            logger.info("tokens file %s re-read: %d tokens", self._path, len(self._tokens))

    def _fail(self, problem: str, stamp: tuple[int, int] | None) -> None:
        """Revoke every token: the file does not read well (logged once per change)."""
        self._tokens, self._stamp = [], stamp
        if problem != self._problem:
            self._problem = problem
            self.reload_failures += 1
            logger.error(
                "tokens file %s: %s; every token is revoked until it reads well",
                self._path,
                problem,
            )

    def _load(self) -> None:
        path = self._path
        try:
            status = path.stat()
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"tokens file {path} cannot be read: {exc}") from exc
        tokens: list[tuple[bytes, Principal]] = []
        where: dict[bytes, int] = {}
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, colon, token = line.partition(":")
            name, token = name.strip(), token.strip()
            if not colon or not name or not token:
                raise ValueError(f"{path}:{number}: expected 'principal:token'")
            problem = principal_problem(name)
            if problem is not None:
                raise ValueError(f"{path}:{number}: {problem}")
            secret = token.encode()
            if secret in where:
                raise ValueError(
                    f"{path}:{number}: the token of line {where[secret]} again "
                    "(each token names one principal, once)"
                )
            where[secret] = number
            tokens.append((secret, Principal(name)))
        self._tokens = tokens
        self._stamp = (status.st_mtime_ns, status.st_size)
        self._problem = None


class ClientCertificate:
    """The principal is the client certificate's identity (``serve --auth-mtls``, with mTLS).

    Its SPIFFE ID if it has one: a ``spiffe://`` URI SAN, exactly one (a
    certificate with two is refused); SPIFFE IDs are read from URI SANs only,
    never from a DNS SAN or the subject. Else its subject's common name, which
    may not look like a SPIFFE ID (a CA that signs ``CN=spiffe://…`` would
    otherwise let it pass for that ID). The TLS handshake already proved the
    certificate is signed by the client CA.
    """

    def authenticate(self, credentials: Credentials) -> Principal:
        """The certificate's SPIFFE ID or common name."""
        peer = credentials.peer
        uris = [san.decode(errors="replace") for san in peer.get("peer_uri", ())]
        spiffe = [uri for uri in uris if uri.lower().startswith(SPIFFE)]
        if len(spiffe) > 1:
            raise AuthenticationError(
                f"the client certificate has {len(spiffe)} SPIFFE IDs; a caller has exactly one"
            )
        if spiffe:
            return Principal(spiffe[0])
        names = [name for name in peer.get("x509_common_name", ()) if name]
        if len(names) == 1:
            name = names[0].decode(errors="replace")
            if name.lower().startswith(SPIFFE):
                raise AuthenticationError(
                    "the client certificate's common name looks like a SPIFFE ID; SPIFFE IDs "
                    "are read from a URI SAN only"
                )
            return Principal(name)
        raise AuthenticationError(
            "this server identifies callers by their client certificate: connect with one "
            "(mTLS) that has a SPIFFE ID (URI SAN) or one common name"
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
        value = credentials.single(self._name).strip()
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
            metadata: dict[str, str] = {}
            repeated: set[str] = set()
            for key, value in context.invocation_metadata() or ():
                if isinstance(value, str):
                    key = key.lower()
                    if key in metadata:
                        repeated.add(key)
                    metadata[key] = value
            try:
                credentials = Credentials(metadata, context.auth_context(), frozenset(repeated))
                named = authenticator.authenticate(credentials)
                principal = await named if inspect.isawaitable(named) else named
                problem = principal_problem(principal.name)
                if problem is not None:
                    raise AuthenticationError(f"the credentials name a principal that {problem}")
            except AuthenticationError as exc:
                await errors.abort(context, exc)
            with serving_as(principal):
                return await behavior(request, context)

        return run


async def _unguardable(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """A synchronous handler of a guarded service: refused (authentication runs on the loop)."""
    await errors.abort(context, UnguardableHandlerError())
