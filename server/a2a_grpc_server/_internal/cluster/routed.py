"""Routed requests between instances: their time bounds, and how their errors cross.

A cancel or follow-up sent through an instance that does not run the task is
routed to the task's owner (see ``cluster``). Whatever carries it (NATS in
``jetstream.routing``, an in-process fake in the tests), the same rules hold:

* the asker waits as long as the client's deadline allows, less
  ``ANSWER_MARGIN`` (so the client reads why it failed), or ``default_wait``
  without a deadline; the owner refuses a request that reaches it with less
  than ``ANSWER_MARGIN`` left;
* the owner's error comes back as the same domain error (``encode_error`` on
  the owner, ``decode_error`` on the asker): its class, its message, and the
  field an invalid-parameter error names;
* the caller crosses as its principal and tenant (``encode_caller``), so the
  owner checks the same scope (see ``scope``) and its executor sees the same
  user; credentials (``CREDENTIALS``: the ``authorization`` header and the
  like) never leave the instance the client called, which already checked them.
"""

from __future__ import annotations

import json

from a2a.utils.errors import (
    A2AError,
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from ..errors import (
    InvalidFieldError,
    OwnerTimeoutError,
    OwnerTooLateError,
    OwnerUnavailableError,
    ServerError,
    ServerShuttingDownError,
    TaskGenerationMismatchError,
    UnknownFormatError,
)
from ..model.caller import Caller
from ..model.principal import Principal
from ..obs import tracing

CANCEL_SLACK = 1.0
"""Seconds an owner's cancel may take beyond its ``cancel_timeout``."""
REPLY_SLACK = 2.0
"""Seconds the asker waits beyond the owner's own bound (without a client deadline)."""
ANSWER_MARGIN = 0.25
"""Seconds before the client's deadline by which the asker answers, and the least time
left for the owner to start the work."""
ERROR = "A2a-Error"
"""Header: the class name of the owner's error."""
FIELD = "A2a-Error-Field"
"""Header: the field an invalid-parameter error names."""
GENERATIONS = "A2a-Error-Generations"
"""Header: a generation mismatch's task, expected and current generation (JSON)."""

ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        TaskNotFoundError,
        TaskNotCancelableError,
        UnsupportedOperationError,
        InvalidParamsError,
        ServerShuttingDownError,
        InternalError,
        OwnerTooLateError,
        OwnerTimeoutError,
        OwnerUnavailableError,
    )
}
"""The errors that cross as themselves; any other comes back as the first of these in
its class's MRO, else as ``InternalError``."""


CREDENTIALS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})
"""Metadata keys that are not sent to the owner (credentials, checked where they arrived)."""


def encode_caller(call: Caller) -> tuple[str, str]:
    """The caller as it crosses to the owner: its metadata, and who it is (two JSON texts)."""
    headers = tracing.inject([pair for pair in call.headers if pair[0] not in CREDENTIALS])
    principal = call.principal.name if call.principal is not None else None
    return json.dumps(headers), json.dumps([principal, call.tenant])


def decode_caller(headers: str, who: str, timeout: float) -> Caller:
    """The caller ``encode_caller`` sent, as the owner serves it (with ``timeout``).

    Raises:
        ValueError: The texts are not what ``encode_caller`` makes.
    """
    pairs = json.loads(headers)
    principal, tenant = json.loads(who) if who else (None, "")
    return Caller(
        tuple((str(k), str(v)) for k, v in pairs),
        timeout,
        Principal(str(principal)) if principal is not None else None,
        str(tenant),
    )


def default_wait(cancel_timeout: float) -> float:
    """Seconds an asker waits for the owner when the client set no deadline."""
    return cancel_timeout + CANCEL_SLACK + REPLY_SLACK


def encode_error(exc: A2AError | ServerError) -> tuple[bytes, dict[str, str]]:
    """The owner's error as a reply: its message, and headers naming its class (and field)."""
    if isinstance(exc, InvalidFieldError):
        return exc.problem.encode(), {ERROR: InvalidParamsError.__name__, FIELD: exc.field}
    text = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, TaskGenerationMismatchError):
        facts = json.dumps([exc.task_id, exc.expected, exc.current])
        return text.encode(), {ERROR: TaskGenerationMismatchError.__name__, GENERATIONS: facts}
    if isinstance(exc, UnknownFormatError):
        # (The asker raises it as OwnerUnavailableError: UNAVAILABLE, retryable, this text.)
        return text.encode(), {ERROR: UnknownFormatError.__name__}
    known = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in ERRORS), None)
    return text.encode(), {ERROR: known or InternalError.__name__}


def decode_error(data: bytes, headers: dict[str, str]) -> Exception | None:
    """The error a reply carries, raised again on the asker (None: the reply is no error)."""
    name = headers.get(ERROR)
    if not name:
        return None
    text = data.decode()
    field = headers.get(FIELD)
    if field is not None:
        return InvalidFieldError(field, text)
    facts = headers.get(GENERATIONS)
    if name == TaskGenerationMismatchError.__name__ and facts is not None:
        try:
            task_id, expected, current = json.loads(facts)
            return TaskGenerationMismatchError(str(task_id), int(expected), int(current))
        except (ValueError, TypeError):
            return OwnerUnavailableError(text)
    return ERRORS.get(name, OwnerUnavailableError)(text)
