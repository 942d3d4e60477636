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
"""

from __future__ import annotations

import json

from a2a.utils.errors import TaskNotFoundError

from ..errors import quote

ANONYMOUS = ""
"""The scope of a call without tenant and without authentication."""


def scope_key(tenant: str, principal: str) -> str:
    """The key of (``tenant``, ``principal``): one line of text, "" for the anonymous scope."""
    if not tenant and not principal:
        return ANONYMOUS
    return json.dumps([tenant, principal], separators=(",", ":"))


def principal_of(scope: str) -> str:
    """The principal of a ``scope_key`` ("" for the anonymous one)."""
    return str(json.loads(scope)[1]) if scope else ""


def not_found(task_id: str) -> TaskNotFoundError:
    """The one answer for a task that does not exist or is in another scope."""
    return TaskNotFoundError(f"task {quote(task_id)} not found")
