"""``NatsConfig``: how an instance joins the cluster.

Importable without nats-py installed, so the command line's settings are
declared from it (see ``settings``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_instance_id() -> str:
    """A fresh id for this process (ownership does not survive a restart)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """How this instance joins the cluster.

    Attributes:
        servers: NATS URLs (any node of the cluster; the client learns the rest).
        instance_id: This instance's id; a new one per process by default.
        replicas: JetStream replicas of the bucket and stream (3 on a 3-node cluster).
        lease: Seconds after an instance's last heartbeat before survivors end its
            tasks FAILED. Keep it above the time JetStream takes to fail over
            (a new stream leader after a node loss: about 5 s measured here),
            or a stalled owner is taken for a lost one.
        task_ttl: Seconds a task's snapshot is kept after its last write.
        events_ttl: Seconds a change is kept in the event stream (how long an
            ended task can be resumed from it).
        events_per_task: Most messages kept per task (oldest dropped first; a
            message holds one write: one change, or a burst committed at
            once), so at least as many changes; the default matches
            ``ServerConfig.log_max_frames``.
        events_max_bytes: Most bytes the event stream keeps (oldest dropped first).
        snapshot_every: Changes between two snapshots of a running task (it is
            also snapshotted when created, when its state changes, and when it
            ends): reading a task folds at most this many changes.
        retry_for: Seconds a read or write keeps retrying through a NATS outage
            or failover before it fails (a change that cannot be recorded ends
            its task FAILED; a final state is retried until it is recorded).
    """

    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    instance_id: str = field(default_factory=new_instance_id)
    replicas: int = 1
    lease: float = 10.0
    task_ttl: float = 86_400.0
    events_ttl: float = 3_600.0
    events_per_task: int = 16_384
    events_max_bytes: int = 1 << 30
    snapshot_every: int = 32
    retry_for: float = 30.0
