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
from a2a.utils.errors import ContentTypeNotSupportedError
from google.protobuf.message import Message as ProtoMessage

from ..config import ServerConfig
from ..errors import InvalidFieldError, quote
from ..model.names import MAX_ID_CHARS, MAX_TOKEN_CHARS

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


def check_send(
    request: SendMessageRequest, config: ServerConfig, input_modes: frozenset[str]
) -> None:
    """Validate SendMessage / SendStreamingMessage.

    Args:
        request: The request.
        config: Limits.
        input_modes: Media types the agent accepts (its card's default and
            skill input modes); empty accepts any.

    Raises:
        InvalidFieldError: A field is missing or malformed.
        ContentTypeNotSupportedError: A part's media type is not accepted.
    """
    check_size(request, config)
    if not request.HasField("message"):
        raise InvalidFieldError("message", "is required")
    _check_message(request.message, config)
    _check_media_types(request.message, input_modes)
    cfg = request.configuration
    if cfg.HasField("history_length") and cfg.history_length < 0:
        raise InvalidFieldError("configuration.history_length", "must not be negative")


def _check_message(message: Message, config: ServerConfig) -> None:
    if not message.message_id:
        raise InvalidFieldError("message.message_id", "is required (a unique id, e.g. a UUID)")
    _check_length("message.message_id", message.message_id)
    _check_length("message.task_id", message.task_id)
    _check_length("message.context_id", message.context_id)
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


def _check_media_types(message: Message, accepted: frozenset[str]) -> None:
    if not accepted or "*/*" in accepted:
        return
    for i, part in enumerate(message.parts):
        media = part.media_type.split(";", 1)[0].strip().lower()
        if not media:
            continue
        major = media.split("/", 1)[0]
        if media not in accepted and f"{major}/*" not in accepted and major not in accepted:
            raise ContentTypeNotSupportedError(
                f"message.parts[{i}] has media type {quote(media)}; this agent accepts "
                f"{', '.join(sorted(accepted))}"
            )


def input_modes(modes: list[str]) -> frozenset[str]:
    """Normalize an agent card's input modes for ``check_send``."""
    return frozenset(m.split(";", 1)[0].strip().lower() for m in modes if m.strip())


def check_task_id(task_id: str, field: str = "id") -> None:
    """Refuse an empty or overlong task id."""
    if not task_id:
        raise InvalidFieldError(field, "is required (the task's id)")
    _check_length(field, task_id)


def check_id(value: str, field: str) -> None:
    """Refuse an empty or overlong id (a push config's)."""
    if not value:
        raise InvalidFieldError(field, "is required")
    _check_length(field, value)


def check_page(page_size: int, page_token: str) -> int:
    """Validate a page size (0: the default) and token; return the page size to use."""
    _check_length("page_token", page_token, MAX_TOKEN_CHARS)
    if page_size == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise InvalidFieldError("page_size", f"must be between 1 and {MAX_PAGE_SIZE}")
    return page_size


def _check_length(field: str, value: str, most: int = MAX_ID_CHARS) -> None:
    """Refuse an overlong id, or one with a control character (ids reach logs and headers)."""
    if len(value) > most:
        raise InvalidFieldError(
            field, f"is {len(value)} characters long; at most {most} are accepted"
        )
    if not value.isprintable():
        raise InvalidFieldError(
            field, "contains a control character (newline, NUL, ...); ids are printable text"
        )


def check_history_length(value: int, present: bool, field: str = "history_length") -> None:
    """Refuse a negative history length."""
    if present and value < 0:
        raise InvalidFieldError(field, "must not be negative")


def check_list(request: ListTasksRequest) -> int:
    """Validate ListTasks and return the page size to use."""
    if request.status not in TaskState.values():
        raise InvalidFieldError("status", f"unknown value {request.status}")
    check_history_length(request.history_length, request.HasField("history_length"))
    _check_length("context_id", request.context_id)
    _check_length("page_token", request.page_token, MAX_TOKEN_CHARS)
    if not request.HasField("page_size"):
        return DEFAULT_PAGE_SIZE
    if not 1 <= request.page_size <= MAX_PAGE_SIZE:
        raise InvalidFieldError("page_size", f"must be between 1 and {MAX_PAGE_SIZE}")
    return request.page_size
