"""Counters of what the server does, in Prometheus text format.

Everything here is plain integers and floats mutated from the event loop
(no locks needed). ``render()`` produces the exposition served at
``/metrics`` on the HTTP port.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tasklog import LogPool

PUSH_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)
CANCEL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Histogram:
    """A cumulative histogram with fixed upper bounds (seconds)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass
class Metrics:
    """What one server instance counted since it started."""

    tasks_started: int = 0
    tasks_ended: Counter[str] = field(default_factory=Counter)
    """Final states, e.g. ``TASK_STATE_CANCELED``; a message-only answer counts as ``MESSAGE``."""
    final_frames: int = 0
    """Final frames handed to streams (one per open stream per ended task)."""
    streams_open: int = 0
    streams_ended: Counter[str] = field(default_factory=Counter)
    """Why streams ended: finished, interrupted, out_of_range, disconnected, error."""
    frames_dropped: int = 0
    """Frames a task's log dropped for its budget (or the server's) while still kept for
    a reader or for resumption."""
    dropped_events: int = 0
    relays_open: int = 0
    """Tasks of other instances this instance relays to its subscribers (cluster mode)."""
    tasks_reaped: int = 0
    """Tasks of a lost instance this instance ended FAILED (cluster mode)."""
    cancel_seconds: Histogram = field(default_factory=lambda: Histogram(CANCEL_BUCKETS))
    """CancelTask received -> the task's final frame in every buffer."""
    push_deliveries: Counter[str] = field(default_factory=Counter)
    """Frames POSTed to webhooks, by outcome: delivered, given_up."""
    push_retries: int = 0
    """Webhook attempts retried."""
    push_in_flight: int = 0
    """Webhook requests in flight now."""
    push_deliveries_running: int = 0
    """(task, config) deliveries following a task's log now."""
    push_frames_skipped: int = 0
    """Times a delivery fell behind the task's log and jumped to the task as it is."""
    push_failing: set[tuple[str, str]] = field(default_factory=set)
    """(task, config) whose last frame was given up (until one is delivered)."""
    push_lag_seconds: Histogram = field(default_factory=lambda: Histogram(PUSH_BUCKETS))
    """First attempt to delivery, per frame delivered (retries included)."""
    pool: LogPool | None = None
    """The instance's task logs, read for their gauges when rendering."""

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4)."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP a2a_{name} {help_text}")
            lines.append(f"# TYPE a2a_{name} {kind}")
            lines.extend(f"a2a_{name}{labels} {_number(v)}" for labels, v in samples)

        metric("tasks_started_total", "counter", "Tasks started.", [("", self.tasks_started)])
        metric(
            "tasks_ended_total",
            "counter",
            "Tasks ended, by final state.",
            [(f'{{state="{s}"}}', n) for s, n in sorted(self.tasks_ended.items())],
        )
        metric(
            "final_frames_total",
            "counter",
            "Final frames delivered to streams.",
            [("", self.final_frames)],
        )
        metric("streams_open", "gauge", "Streams being served.", [("", self.streams_open)])
        metric(
            "streams_ended_total",
            "counter",
            "Streams ended, by reason.",
            [(f'{{reason="{r}"}}', n) for r, n in sorted(self.streams_ended.items())],
        )
        metric(
            "log_frames_dropped_total",
            "counter",
            "Frames task logs dropped for their byte or frame budget.",
            [("", self.frames_dropped)],
        )
        metric(
            "dropped_events_total",
            "counter",
            "Executor events dropped (after the task ended).",
            [("", self.dropped_events)],
        )
        metric(
            "relays_open",
            "gauge",
            "Tasks of other instances relayed here.",
            [("", self.relays_open)],
        )
        if self.pool is not None:
            metric(
                "log_bytes",
                "gauge",
                "Bytes the task logs keep (frames plus 64 each).",
                [("", self.pool.used)],
            )
            metric(
                "logs_retained",
                "gauge",
                "Ended tasks whose log is kept for resuming.",
                [("", self.pool.retained_count)],
            )
        metric(
            "tasks_reaped_total",
            "counter",
            "Tasks of lost instances ended FAILED by this instance.",
            [("", self.tasks_reaped)],
        )
        metric(
            "push_deliveries_total",
            "counter",
            "Frames POSTed to webhooks, by outcome (delivered, given_up).",
            [(f'{{outcome="{o}"}}', n) for o, n in sorted(self.push_deliveries.items())],
        )
        metric(
            "push_retries_total", "counter", "Webhook attempts retried.", [("", self.push_retries)]
        )
        metric(
            "push_in_flight", "gauge", "Webhook requests in flight.", [("", self.push_in_flight)]
        )
        metric(
            "push_deliveries_running",
            "gauge",
            "Webhooks following a task's log.",
            [("", self.push_deliveries_running)],
        )
        metric(
            "push_frames_skipped_total",
            "counter",
            "Times a webhook fell behind its task's log and got the task as it was instead.",
            [("", self.push_frames_skipped)],
        )
        metric(
            "push_failing_configs",
            "gauge",
            "Webhooks whose last frame was given up.",
            [("", len(self.push_failing))],
        )
        _histogram(lines, "cancel_seconds", "CancelTask to final frame.", self.cancel_seconds)
        _histogram(
            lines,
            "push_delivery_seconds",
            "First attempt to delivery of a frame to a webhook (retries included).",
            self.push_lag_seconds,
        )
        return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_text: str, h: Histogram) -> None:
    cumulative = 0
    samples: list[tuple[str, float]] = []
    for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
        cumulative += count
        le = "+Inf" if bound == float("inf") else _number(bound)
        samples.append((f'_bucket{{le="{le}"}}', cumulative))
    samples += [("_sum", h.total), ("_count", h.n)]
    lines.append(f"# HELP a2a_{name} {help_text}")
    lines.append(f"# TYPE a2a_{name} histogram")
    lines.extend(f"a2a_{name}{suffix} {_number(v)}" for suffix, v in samples)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
