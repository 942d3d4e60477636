"""Request validation: every malformed request is refused here, before any work starts.

Each check raises ``InvalidFieldError`` naming the field and saying how to fix
it; ``errors`` turns that into INVALID_ARGUMENT with a ``BadRequest`` detail.
"""

from __future__ import annotations

from a2a.types.a2a_pb2 import (
    ListTasksRequest,
    Message,
    Role,
    SendMessageRequest,
    TaskState,
)
from google.protobuf.message import Message as ProtoMessage

from .config import ServerConfig
from .errors import InvalidFieldError

MAX_PAGE_SIZE = 100
DEFAULT_PAGE_SIZE = 50


def check_size(request: ProtoMessage, config: ServerConfig) -> None:
    """Refuse a request larger than ``config.max_message_bytes``."""
    size = request.ByteSize()
    if size > config.max_message_bytes:
        raise InvalidFieldError(
            "request",
            f"is {size} bytes; this server accepts at most {config.max_message_bytes} bytes "
            "(send large content by URL in a part)",
        )


def check_send(request: SendMessageRequest, config: ServerConfig) -> None:
    """Validate SendMessage / SendStreamingMessage."""
    check_size(request, config)
    if not request.HasField("message"):
        raise InvalidFieldError("message", "is required")
    _check_message(request.message, config)
    cfg = request.configuration
    if cfg.HasField("history_length") and cfg.history_length < 0:
        raise InvalidFieldError("configuration.history_length", "must not be negative")


def _check_message(message: Message, config: ServerConfig) -> None:
    if not message.message_id:
        raise InvalidFieldError("message.message_id", "is required (a unique id, e.g. a UUID)")
    if message.role not in Role.values():
        raise InvalidFieldError("message.role", f"unknown value {message.role}; send ROLE_USER")
    if message.role != Role.ROLE_USER:
        raise InvalidFieldError(
            "message.role", f"is {Role.Name(message.role)}; messages to an agent must be ROLE_USER"
        )
    if not message.parts:
        raise InvalidFieldError("message.parts", "must hold at least one part")
    if len(message.parts) > config.max_parts:
        raise InvalidFieldError(
            "message.parts",
            f"holds {len(message.parts)} parts; at most {config.max_parts} are accepted",
        )
    for i, part in enumerate(message.parts):
        if part.WhichOneof("content") is None:
            raise InvalidFieldError(
                f"message.parts[{i}]", "has no content; set one of text, raw, url or data"
            )


def check_task_id(task_id: str, field: str = "id") -> None:
    """Refuse an empty task id."""
    if not task_id:
        raise InvalidFieldError(field, "is required (the task's id)")


def check_history_length(value: int, present: bool, field: str = "history_length") -> None:
    """Refuse a negative history length."""
    if present and value < 0:
        raise InvalidFieldError(field, "must not be negative")


def check_list(request: ListTasksRequest) -> int:
    """Validate ListTasks and return the page size to use."""
    if request.status not in TaskState.values():
        raise InvalidFieldError("status", f"unknown value {request.status}")
    check_history_length(request.history_length, request.HasField("history_length"))
    if not request.HasField("page_size"):
        return DEFAULT_PAGE_SIZE
    if not 1 <= request.page_size <= MAX_PAGE_SIZE:
        raise InvalidFieldError("page_size", f"must be between 1 and {MAX_PAGE_SIZE}")
    return request.page_size
