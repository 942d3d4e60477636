"""JwtAuthenticator: JWT bearer tokens verified with PyJWT against a JWKS (``serve --auth-jwt-*``).

A call carries ``authorization: Bearer <JWT>``. The token must be signed by a
key of the JWKS (selected by its ``kid``), unexpired, issued by ``issuer``
for ``audience``; its ``claim`` (``sub`` by default) names the principal.
The JWKS comes from a file or an https URL (``http://`` only to a loopback
host, and only when allowed explicitly); it is read at start (a URL: at the
first call) and read again when a token names a key it does not hold (a key
rotation), at most once per ``REFRESH_EVERY`` seconds whatever the endpoint
answers, and one read at a time (concurrent calls share it), so neither
unknown key ids nor a failing endpoint can make the server hammer it. Until
a first read has succeeded (no key held: every call is refused), a failed
read is retried sooner: after ``FIRST_RETRY`` seconds, doubling after each
failure up to ``REFRESH_EVERY`` (with jitter, less up to a fifth, so a fleet
started while the endpoint was down does not retry in step): an endpoint
down for a moment at start does not mean 30 s of UNAUTHENTICATED.

Who runs what: ``authenticate`` runs on the event loop at the start of each
call (see ``auth``); a refresh from a URL is an ``await`` there (httpx).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jwt
from a2a.types.a2a_pb2 import HTTPAuthSecurityScheme, SecurityScheme

from .auth import AuthenticationError, Credentials, Principal

logger = logging.getLogger(__name__.replace("._internal", ""))

REFRESH_EVERY = 30.0
"""Least seconds between two reads of the JWKS for an unknown key id."""
FIRST_RETRY = 1.0
"""Seconds before a failed read is retried while no key is held (then doubling)."""
LEEWAY = 30.0
"""Seconds of clock skew tolerated on ``exp`` and ``nbf``."""
FETCH_TIMEOUT = 5.0
MAX_JWKS_BYTES = 1024 * 1024


class JwtAuthenticator:
    """See the module docstring.

    Args:
        jwks: A JWKS file, or an https URL serving one.
        issuer: The ``iss`` every token must carry.
        audience: The ``aud`` every token must carry.
        claim: The claim that names the principal.
        allow_http_loopback: Accept an ``http://`` URL to a loopback host
            (127.0.0.1, ::1, localhost): a JWKS served beside the server.
        clock: Monotonic clock (seconds) that paces the reads.

    Raises:
        ValueError: The JWKS file cannot be read or holds no usable key, or
            the URL is not https (nor an allowed loopback http one).
    """

    def __init__(
        self,
        jwks: str,
        issuer: str,
        audience: str,
        claim: str = "sub",
        *,
        allow_http_loopback: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._source, self._issuer, self._audience, self._claim = jwks, issuer, audience, claim
        self._keys: dict[str, jwt.PyJWK] = {}
        self._clock = clock
        self._read_at: float | None = None
        self._pause = REFRESH_EVERY
        """Least seconds from the last read's start to the next one's."""
        self._backoff = FIRST_RETRY
        self._reading: asyncio.Future[bool] | None = None
        if jwks.startswith("http://") and not (allow_http_loopback and _loopback(jwks)):
            raise ValueError(
                f"JWKS URL {jwks} is not https: keys fetched in the clear can be replaced on "
                "the way (http is accepted only for a loopback host, with "
                "--auth-jwt-allow-http-loopback)"
            )
        if not self._is_url():
            self._use(self._read_file())

    def card_scheme(self) -> tuple[str, SecurityScheme]:
        """Bearer JWTs (see ``auth.declared_scheme``)."""
        http = HTTPAuthSecurityScheme(scheme="Bearer", bearer_format="JWT")
        return "bearer", SecurityScheme(http_auth_security_scheme=http)

    async def authenticate(self, credentials: Credentials) -> Principal:
        """The principal the call's verified JWT names."""
        scheme, _, token = credentials.single("authorization").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError(
                "this server requires a JWT: send metadata 'authorization: Bearer <JWT>'"
            )
        try:
            kid = jwt.get_unverified_header(token).get("kid", "")
        except jwt.InvalidTokenError:
            raise AuthenticationError("the bearer token is not a JWT") from None
        key = self._keys.get(kid)
        if key is None and await self._refresh():
            key = self._keys.get(kid)
        if key is None:
            raise AuthenticationError("the JWT is signed by a key this server does not know")
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key=key,
                algorithms=[key.algorithm_name],
                audience=self._audience,
                issuer=self._issuer,
                leeway=LEEWAY,
                options={"require": ["exp", "iss", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise AuthenticationError("the JWT has expired") from None
        except jwt.InvalidAudienceError:
            raise AuthenticationError(f"the JWT is not for audience {self._audience!r}") from None
        except jwt.InvalidIssuerError:
            raise AuthenticationError(f"the JWT is not issued by {self._issuer!r}") from None
        except jwt.InvalidTokenError as exc:
            raise AuthenticationError(f"the JWT is not valid ({type(exc).__name__})") from None
        name = claims.get(self._claim)
        if not isinstance(name, str) or not name:
            raise AuthenticationError(f"the JWT has no {self._claim!r} claim naming the caller")
        return Principal(name)

    async def _refresh(self) -> bool:
        """Read the JWKS again (paced as the module docstring says, one read at a time).

        Returns:
            Whether it was read (by this call or by the one it joined).
        """
        reading = self._reading
        if reading is None:
            now = self._clock()
            if self._read_at is not None and now - self._read_at < self._pause:
                return False
            self._read_at = now
            reading = self._reading = asyncio.ensure_future(self._read_again())
            reading.add_done_callback(self._read_done)
        return await asyncio.shield(reading)

    def _read_done(self, reading: asyncio.Future[bool]) -> None:
        self._reading = None

    async def _read_again(self) -> bool:
        try:
            document = await self._fetch() if self._is_url() else self._read_file()
            self._use(document)
        except (ValueError, OSError, httpx.HTTPError, TypeError, AttributeError) as exc:
            if self._keys:
                logger.warning(
                    "JWKS %s not read again: %s; keeping the keys held", self._source, exc
                )
                self._pause = REFRESH_EVERY
            else:
                # Nothing held: every call is refused until a read succeeds.
                self._pause = self._backoff * random.uniform(0.8, 1.0)  # (jitter)
                self._backoff = min(self._backoff * 2, REFRESH_EVERY)
                logger.warning(
                    "JWKS %s not read: %s; no key held, next read in %.1f s at the earliest",
                    self._source,
                    exc,
                    self._pause,
                )
            return False
        self._pause = REFRESH_EVERY
        return True

    def _is_url(self) -> bool:
        return self._source.startswith(("https://", "http://"))

    def _read_file(self) -> Any:
        try:
            return json.loads(Path(self._source).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"JWKS file {self._source} cannot be read: {exc}") from exc

    async def _fetch(self) -> Any:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT, trust_env=False) as client:
            answer = await client.get(self._source)
            answer.raise_for_status()
            if len(answer.content) > MAX_JWKS_BYTES:
                raise ValueError(f"the JWKS is larger than {MAX_JWKS_BYTES} bytes")
            return answer.json()

    def _use(self, document: Any) -> None:
        keys: dict[str, jwt.PyJWK] = {}
        for entry in (document or {}).get("keys", []) if isinstance(document, dict) else []:
            try:
                keys[str(entry.get("kid", ""))] = jwt.PyJWK(entry)
            except (jwt.PyJWKError, jwt.InvalidKeyError, TypeError) as exc:
                logger.warning("JWKS %s: a key is not usable (%s)", self._source, exc)
        if not keys:
            raise ValueError(f"JWKS {self._source} holds no usable key")
        self._keys = keys


def _loopback(url: str) -> bool:
    """Whether ``url``'s host is a loopback address (or ``localhost``)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
