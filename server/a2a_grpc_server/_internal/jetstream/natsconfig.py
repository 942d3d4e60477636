"""``NatsConfig``: how an instance joins the cluster.

Importable without nats-py installed, so the command line's settings are
declared from it (see ``settings``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

MAX_EVENT_STREAMS = 64
"""The most event streams a cluster's record is spread over (``NatsConfig.event_streams``)."""


def without_userinfo(url: str) -> str:
    """``url`` without a ``user:password@`` or ``token@`` part, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


_NOT_A_TOKEN = frozenset(".*> \t\r\n")
"""Characters no NATS subject token holds (an instance id is one: ``a2a.ctl.<id>.…``)."""


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
        task_ttl: Seconds a task's snapshot is kept after its last write; in the
            task log (the default), each change is kept this long after its write.
        events_ttl: Seconds a change is kept in the event stream (how long an
            ended task can be resumed from it). Tasks in the snapshot bucket
            (format 2) only, as the three below.
        events_per_task: Most messages kept per task (oldest dropped first; a
            message holds one write: one change, or a burst committed at
            once), so at least as many changes; the default matches
            ``ServerConfig.log_max_frames``.
        events_max_bytes: Most bytes the event stream keeps (oldest dropped first).
        event_streams: Event streams the record is spread over (``A2A_EVENTS``, then
            ``A2A_EVENTS_1`` …): each new task goes to one by its id's hash, named in
            its snapshot, so writes spread over as many JetStream stream leaders on
            a NATS cluster (each stream has the limits above). Changing it moves new
            tasks only; instances may differ. 1 for a small cluster; at most 64.
        snapshot_every: Changes between two snapshots of a running task (it is
            also snapshotted when created, when its state changes, and when it
            ends): reading a task folds at most this many changes.
        retry_for: Seconds a read or write keeps retrying through a NATS outage
            or failover before it fails (a change that cannot be recorded ends
            its task FAILED; a final state is retried until it is recorded).
        key_file: A file holding the secret every instance of the cluster shares
            (at least 32 bytes, e.g. ``openssl rand -hex 32``): routed requests and
            their answers are signed with it, so a client of the NATS bus alone
            cannot act as an instance. Required unless ``trust_bus``.
        trust_bus: Accept routed requests that are not signed (and join without
            ``key_file``): only for a bus whose permissions keep every other
            client off the ``a2a.ctl`` subjects, or while upgrading from a
            version before signing.
        creds_file: A NATS credentials file (JWT and nkey seed; needs the
            ``nkeys`` package).
        nkey_seed_file: A file holding a NATS nkey seed (needs ``nkeys``).
        token_file: A file holding a NATS authentication token.
        user: A NATS user name (with ``password_file``).
        password_file: A file holding that user's password.
        tls_ca: CA certificates (PEM) to verify the NATS servers with (TLS to NATS;
            without it, with ``tls_cert``, the system's CAs).
        tls_cert: A client certificate (PEM) to present to NATS (with ``tls_key``).
        tls_key: The client certificate's private key (PEM).
        routed_in_flight: Most routed requests (cancels, follow-ups, push configs
            sent by other instances) this instance serves at once. Past it a
            cancel or follow-up is refused at once, before anything is done
            (the client gets UNAVAILABLE ``OWNER_UNAVAILABLE`` and retries); a
            push config waits for room (refusing it would leave its webhook
            without a deliverer while the owner lives).
        task_log: Create new tasks in the task log (format 3: one acknowledged write
            per change; docs/decisions/0001-cluster-store-layout.md) once every
            live instance reads it (from the version before this one on). Off:
            in the snapshot bucket, as versions before did (format 2; the way
            back if the log misbehaves; every instance still reads both).
    """

    servers: list[str] = field(default_factory=lambda: ["nats://127.0.0.1:4222"])
    instance_id: str = field(default_factory=new_instance_id)
    replicas: int = 1
    lease: float = 10.0
    task_ttl: float = 86_400.0
    events_ttl: float = 3_600.0
    events_per_task: int = 16_384
    events_max_bytes: int = 1 << 30
    event_streams: int = 1
    snapshot_every: int = 32
    retry_for: float = 30.0
    key_file: str | None = None
    trust_bus: bool = False
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    token_file: str | None = None
    user: str | None = None
    password_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    routed_in_flight: int = 256
    task_log: bool = True
    key: bytes | None = None
    """The shared key itself, for embedders and tests (instead of ``key_file``; not a
    setting)."""

    def __post_init__(self) -> None:
        if self.routed_in_flight < 1:
            raise ValueError("routed_in_flight must be positive")
        if not self.instance_id:  # (the empty id is nobody's: released tasks, never swept)
            raise ValueError("instance_id must not be empty")
        if not _NOT_A_TOKEN.isdisjoint(self.instance_id):  # (it names subjects and keys)
            raise ValueError(
                f"instance_id {self.instance_id!r} must be one NATS subject token: "
                "no '.', '*', '>' or whitespace"
            )
