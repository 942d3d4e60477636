"""Server settings: every bound the server enforces, in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Tunable limits of an A2A server instance.

    Attributes:
        subscriber_buffer: Frames buffered per stream subscriber, including the
            slot reserved for the final frame. A subscriber that falls this far
            behind is evicted (its stream ends RESOURCE_EXHAUSTED).
        event_queue_size: Events an executor may have in flight before
            ``enqueue_event`` waits for the consumer (back-pressure).
        cancel_timeout: Seconds CancelTask waits for the executor's ``cancel()``
            to end the task before the server synthesizes CANCELED itself.
        max_final_tasks: Final tasks kept in the in-memory store; the oldest
            final task is evicted first.
        final_task_ttl: Seconds a final task is kept in the in-memory store.
        max_message_bytes: Largest request the gRPC server accepts.
        max_parts: Most parts one message may carry.
        shutdown_grace: Seconds running tasks get to finish on shutdown before
            they are ended FAILED.
    """

    subscriber_buffer: int = 256
    event_queue_size: int = 1024
    cancel_timeout: float = 3.0
    max_final_tasks: int = 10_000
    final_task_ttl: float = 3600.0
    max_message_bytes: int = 4 * 1024 * 1024
    max_parts: int = 1000
    shutdown_grace: float = 10.0

    def __post_init__(self) -> None:
        if self.subscriber_buffer < 2:
            raise ValueError("subscriber_buffer must be at least 2 (one slot is reserved)")
        if self.event_queue_size < 1:
            raise ValueError("event_queue_size must be positive")
        if self.cancel_timeout <= 0:
            raise ValueError("cancel_timeout must be positive")
        if self.max_final_tasks < 0 or self.final_task_ttl < 0:
            raise ValueError("retention limits must not be negative")
