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
        h = self.cancel_seconds
        cumulative = 0
        samples: list[tuple[str, float]] = []
        for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else _number(bound)
            samples.append((f'_bucket{{le="{le}"}}', cumulative))
        samples += [("_sum", h.total), ("_count", h.n)]
        lines.append("# HELP a2a_cancel_seconds CancelTask to final frame.")
        lines.append("# TYPE a2a_cancel_seconds histogram")
        lines.extend(f"a2a_cancel_seconds{suffix} {_number(v)}" for suffix, v in samples)
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
