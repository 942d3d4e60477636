"""Who calls: the public names of authentication, for embedders.

An embedder's own authenticator implements ``Authenticator``, raises
``AuthenticationError`` and returns a ``Principal``. ``A2AServer(auth=...)`` guards
its service; a ``grpc.aio`` server of your own adds ``AuthInterceptor(authenticator)``
after ``A2AService.interceptors()``.
"""

from __future__ import annotations

from ._internal.rpc.auth import (
    AuthenticationError,
    Authenticator,
    AuthInterceptor,
    ClientCertificate,
    Credentials,
    Principal,
    TokenFile,
    TrustedHeader,
    current_principal,
)

__all__ = [
    "AuthInterceptor",
    "AuthenticationError",
    "Authenticator",
    "ClientCertificate",
    "Credentials",
    "Principal",
    "TokenFile",
    "TrustedHeader",
    "current_principal",
]
