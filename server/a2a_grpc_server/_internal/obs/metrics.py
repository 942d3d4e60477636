"""Counters of what the server does.

Everything here is plain integers and floats mutated from the event loop
(no locks needed: counting costs an increment). ``collector.A2ACollector``
turns them into Prometheus metrics when they are scraped.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

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
    tasks_released: int = 0
    """Waiting tasks this instance left to the cluster: its own at shutdown, and a lost
    instance's when it swept (cluster mode)."""
    tasks_claimed: int = 0
    """Waiting tasks owned by nobody that this instance took over to continue (cluster mode)."""
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
