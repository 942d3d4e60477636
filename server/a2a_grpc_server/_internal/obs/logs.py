"""Logging: plain text by default, or one JSON object per line (``--log-format json``).

Both go through the standard ``logging`` module, so an embedder's own
configuration keeps working. A JSON line holds ``time`` (RFC 3339, UTC),
``level``, ``logger``, ``message``, and, when known, ``task_id`` and
``context_id`` (set for everything a task's run logs, the agent's own
logging included), ``principal`` (the authenticated caller), ``instance``
(this instance's id) and ``trace_id`` (the current OpenTelemetry trace, when
tracing is installed and a span is active); an exception adds ``exception``.

Who runs what: ``task_fields`` is set by the run of each task
(``supervisor``) and read, like the principal, from context variables, so
every coroutine and callback of that run carries them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_principal: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "a2a_grpc_server_log_principal", default=None
)


def bind_principal(name: str) -> contextvars.Token[str | None]:
    """Name ``name`` as the principal on the log lines of what runs from here on."""
    return _principal.set(name)


def unbind_principal(token: contextvars.Token[str | None]) -> None:
    """Undo a ``bind_principal``."""
    _principal.reset(token)


_task: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "a2a_grpc_server_log_task", default=None
)


def task_fields(task_id: str, context_id: str) -> None:
    """Mark what runs from here on (in this context) as work of this task."""
    _task.set((task_id, context_id))


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see the module docstring).

    Args:
        instance: This instance's id ("" for none).
    """

    def __init__(self, instance: str = "") -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        task = _task.get()
        if task is not None:
            line["task_id"], line["context_id"] = task
        principal = _principal.get()
        if principal is not None:
            line["principal"] = principal
        if self.instance:
            line["instance"] = self.instance
        trace_id = _trace_id()
        if trace_id:
            line["trace_id"] = trace_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


QUIET_LIBRARIES = ("httpx", "httpcore")
"""Libraries whose INFO lines are per request: logged from WARNING (DEBUG: everything)."""


def configure(level: str, log_format: str, instance: str = "") -> None:
    """Log to stderr at ``level`` in ``log_format`` (``text`` or ``json``).

    Raises:
        ValueError: An unknown format.
    """
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: choose one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(instance))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The webhook client logs a line per POST at INFO; ours say what matters (a frame
    # given up, a webhook failing). Its own lines come back with --log-level DEBUG.
    quiet = logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(quiet)


def set_instance(instance: str) -> None:
    """Name this instance in every JSON line from now on (its cluster id, once known)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.instance = instance


def _trace_id() -> str:
    """The current OpenTelemetry trace id (hex), or "" (none active, or not installed)."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return ""  # not imported by anyone: no span can be active
    context = trace.get_current_span().get_span_context()  # type: ignore[attr-defined]
    return f"{context.trace_id:032x}" if context.is_valid else ""
