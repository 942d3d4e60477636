"""Who calls: the public names of authentication, for embedders (see ``rpc.auth``).

An embedder's own authenticator implements ``Authenticator``, raises
``AuthenticationError`` and returns a ``Principal``.
"""

from __future__ import annotations

from .rpc.auth import (
    AuthenticationError,
    Authenticator,
    ClientCertificate,
    Credentials,
    Principal,
    TokenFile,
    TrustedHeader,
    current_principal,
)

__all__ = [
    "AuthenticationError",
    "Authenticator",
    "ClientCertificate",
    "Credentials",
    "Principal",
    "TokenFile",
    "TrustedHeader",
    "current_principal",
]
