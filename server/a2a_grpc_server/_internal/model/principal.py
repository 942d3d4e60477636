"""Who a call comes from, and the principal of the call being served.

Who runs what: the authentication interceptor (``rpc.auth``) serves each
call inside ``serving_as(principal)``; everything that call runs (the
handler, the executor's runs it starts) reads ``current_principal()``, and
log lines carry the name (``obs.logs``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from a2a.auth.user import User

from ..obs import logs

MAX_PRINCIPAL_CHARS = 256
"""Longest principal name (it is stored with every task of the principal)."""


def principal_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a principal's name (None: nothing).

    1 to ``MAX_PRINCIPAL_CHARS`` printable characters: no control
    characters (a newline or NUL in a name would forge log lines and header
    values downstream).
    """
    if not name or len(name) > MAX_PRINCIPAL_CHARS:
        return f"has {len(name)} characters (this server takes 1 to {MAX_PRINCIPAL_CHARS})"
    if not name.isprintable():
        return "holds a control character (a principal's name is printable)"
    return None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a call comes from.

    Attributes:
        name: The principal's name (tokens file: the part before the colon).
    """

    name: str


_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "a2a_grpc_server_principal", default=None
)


def current_principal() -> Principal | None:
    """The principal of the call being served (None without authentication)."""
    return _principal.get()


@contextlib.contextmanager
def serving_as(principal: Principal) -> Iterator[None]:
    """Serve what runs inside as ``principal`` (and name it on log lines)."""
    token = _principal.set(principal)
    named = logs.bind_principal(principal.name)
    try:
        yield
    finally:
        logs.unbind_principal(named)
        _principal.reset(token)


class PrincipalUser(User):
    """A principal as a2a-sdk's ``User`` (what ``context.call_context.user`` is)."""

    def __init__(self, principal: Principal) -> None:
        self.principal = principal

    @property
    def is_authenticated(self) -> bool:
        """Always: it passed the authenticator."""
        return True

    @property
    def user_name(self) -> str:
        """The principal's name."""
        return self.principal.name
