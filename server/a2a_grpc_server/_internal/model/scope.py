"""Whose a task is: the (tenant, principal) that created it, as one key.

A task belongs to the scope of the call that created it: the request's
``tenant`` and the authenticated principal (see ``auth``). Every later call
on the task (GetTask, SubscribeToTask, CancelTask, a follow-up message, the
push-config RPCs) must come from the same scope, and ListTasks lists only
the caller's scope. A call from any other scope is answered exactly as for
an id that does not exist (``not_found``), so a caller cannot tell another
caller's task from a missing one.

The key is stored with the task in every journal. Without an authenticator
and without tenants every call has the empty scope, so everything is as if
there were no scopes at all.

A context belongs to its scope too (``context_for``): an executor that keeps
memory per context (a common pattern) must never hand one caller another's
conversation, so a new task joins a context only if that context id was
issued for the caller's scope.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid

from a2a.utils.errors import TaskNotFoundError

from ..errors import quote

ANONYMOUS = ""
"""The scope of a call without tenant and without authentication."""


def scope_key(tenant: str, principal: str) -> str:
    """The key of (``tenant``, ``principal``): one line of text, "" for the anonymous scope."""
    if not tenant and not principal:
        return ANONYMOUS
    return json.dumps([tenant, principal], separators=(",", ":"))


def context_for(scope: str, asked: str) -> str:
    """The context id of a new task of ``scope`` whose message named ``asked`` ("" for none).

    Any scope but the anonymous one (a principal, or only a tenant) is issued
    ids that carry its tag (``<uuid>.<tag>``, a hash of the scope and the
    uuid): ``asked`` is taken only if it carries this scope's tag; any other
    id, another scope's or one never issued, gets a fresh context: the same
    answer for both, so a caller can neither join another's context nor
    learn that it exists.

    The anonymous scope takes ``asked`` as it is (or a fresh id), as if there
    were no scopes, except an id in the issued form: that one is another
    scope's (the anonymous scope is never issued one; a server without an
    authenticator may serve tenant-less callers beside tenants), so it gets
    a fresh context too.
    """
    if scope == ANONYMOUS:
        return asked if asked and not _issued_form(asked) else str(uuid.uuid4())
    if asked:
        base, dot, tag = asked.rpartition(".")
        # (bytes: compare_digest refuses a str that is not ASCII, and ids are any text)
        if dot and hmac.compare_digest(tag.encode(), _context_tag(scope, base).encode()):
            return asked
    base = str(uuid.uuid4())
    return f"{base}.{_context_tag(scope, base)}"


def _issued_form(context_id: str) -> bool:
    """Whether ``context_id`` reads as issued to a scope (``<base>.<tag>``)."""
    _, dot, tag = context_id.rpartition(".")
    return bool(dot) and len(tag) == _TAG_CHARS and all(c in _HEX for c in tag)


_TAG_CHARS = 16
_HEX = frozenset("0123456789abcdef")


def _context_tag(scope: str, base: str) -> str:
    return hashlib.blake2s(
        f"{scope}\n{base}".encode(), digest_size=_TAG_CHARS // 2, person=b"a2a-ctx"
    ).hexdigest()


def principal_of(scope: str) -> str:
    """The principal of a ``scope_key`` ("" for the anonymous one)."""
    return str(json.loads(scope)[1]) if scope else ""


def not_found(task_id: str) -> TaskNotFoundError:
    """The one answer for a task that does not exist or is in another scope."""
    return TaskNotFoundError(f"task {quote(task_id)} not found")
