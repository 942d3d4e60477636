"""Server settings: every bound the server enforces, in one place."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

DEFAULT_MAX_TASK_BYTES = 4 * 1024 * 1024 - 64 * 1024
"""gRPC's default receive limit (4 MiB) less room for an answer's own fields."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Tunable limits of an A2A server instance.

    Attributes:
        log_max_frames: Most frames a task's log keeps (the oldest go first; the
            final frame is never dropped). A stream whose next frame was dropped
            ends OUT_OF_RANGE. The default holds a burst of 10,000 frames.
        log_max_bytes: Most bytes a task's log keeps (each frame counts its size
            plus 64).
        log_total_bytes: Most bytes the logs of all tasks keep together; beyond
            it, ended tasks kept for resumption go first, then the oldest frames
            of the task being appended to.
        resume_window: Seconds a frame stays in the log after it was appended,
            for clients that activated the resume extension (an ended task
            stays resumable that long); frames nobody can resume from are
            released once every open stream has read them.
        event_queue_size: Events an executor may have in flight before
            ``enqueue_event`` waits for the consumer (back-pressure).
        event_queue_bytes: Bytes of events an executor may have in flight before
            ``enqueue_event`` waits (one larger event still goes through alone).
        cancel_timeout: Seconds CancelTask waits for the executor's ``cancel()``
            to end the task before the server synthesizes CANCELED itself.
        max_final_tasks: Final tasks kept in the in-memory journal; the oldest
            final task is evicted first.
        final_task_ttl: Seconds a final task is kept in the in-memory journal.
        max_final_bytes: Bytes of final tasks (serialized) kept in the in-memory
            journal. Over it, or over ``max_final_tasks``, the task evicted is the
            oldest of the caller keeping the most: one caller's many (or large)
            results never evict another's first.
        max_message_bytes: Largest request the server accepts (serialized); at
            most half of ``max_task_bytes``, so the task a message starts always
            fits.
        max_task_bytes: Largest task the server keeps (serialized: history,
            artifacts, status); it also bounds every frame and every answer. An
            executor event that could take its task past it ends the task
            FAILED; a follow-up message that would is refused. The default
            keeps every answer under gRPC's default 4 MiB receive limit, so
            clients with default settings read every answer; raise it (and
            the clients' limit) for larger tasks. In cluster mode it is
            lowered to what one NATS message carries (see
            the cluster's largest record).
        max_parts: Most parts one message may carry.
        parked_timeout: Seconds a task waiting for input (INPUT_REQUIRED,
            AUTH_REQUIRED) with no open stream stays in memory; then it leaves
            memory (its record stays in the journal, and a follow-up, a
            subscription or a cancel brings it back).
        max_parked_tasks: Most tasks waiting for input this instance holds.
            Over it, with the in-memory journal a new task is refused
            (RESOURCE_EXHAUSTED, PARKED_TASKS_LIMIT) and a running task that
            asks for input ends FAILED; in cluster mode the longest-waiting
            unread task leaves memory early instead.
        shutdown_drain: Seconds ``serve`` goes on accepting calls after SIGTERM
            while its health says NOT_SERVING, so load balancers and a
            Kubernetes Service stop routing to it before it stops accepting
            (clients then never meet a refused connection); in addition to
            ``shutdown_timeout``. Set it above your endpoint propagation time
            (the shipped manifest sets 5 s, with a readiness probe).
        shutdown_grace: Seconds running tasks get to finish on shutdown before
            they are ended FAILED (in cluster mode a task waiting for input is
            not ended: it is left to the cluster).
        shutdown_timeout: Seconds a shutdown takes at most, everything included:
            the grace, ending the remaining tasks (all at once, each with its
            final frame whether or not the journal records it in time), and
            flushing the final frames to clients.
        shutdown_flush: Seconds of ``shutdown_timeout`` kept for gRPC to deliver
            the final frames before connections close.
        loop_slice: Seconds of bulk work (executors emitting, events committed,
            frames written) the event loop runs before it polls its sockets
            again; the rest waits for the next slice (see ``pacing``). It keeps
            a burst to many tasks from stalling every other call (a GetTask
            took seconds during a burst to 20 streams). 0 turns pacing off.
        push: Whether push notifications are served (the card's
            ``capabilities.push_notifications``); off, the push-config RPCs and
            a SendMessage carrying a config answer PushNotificationNotSupported.
            An agent whose own card says ``push_notifications: false`` turns
            them off too (a card that says nothing leaves it to this setting).
        push_max_configs: Most push configs per task.
        push_timeout: Seconds one webhook request may take.
        push_retry_for: Seconds one frame is retried before it is given up
            (then the webhook gets the task as it is and delivery goes on).
        push_max_in_flight: Most webhook requests in flight at once, and connections
            open to webhooks (busy and idle together).
        push_allow_private: Allow http and private, loopback and link-local
            webhook addresses (tests, webhooks inside the same network).
        push_allow_hosts: Webhook host names trusted whatever they resolve to
            (``*.example.com`` for subdomains); still https only.
        push_ca_file: A PEM bundle of the CAs webhook certificates are verified
            against (an internal CA); "" for the public CAs (certifi's bundle).
        quota_live_tasks: Most tasks one principal has live on this instance
            (not ended and in memory, waiting for input included); over it a
            new task is refused (RESOURCE_EXHAUSTED, LIVE_TASKS_QUOTA). 0: no quota.
        generation: Number tasks and frames with A2A v1.1's generation
            (``Task.generation`` 7, the update events' 5 and 7, appended to
            the v1.0 wire: v1.0 clients ignore them), and honour v1.1's
            ``GetTaskRequest.current_generation`` (a long-poll) and
            ``SendMessageConfiguration.if_generation_match`` (ABORTED
            TASK_GENERATION_MISMATCH). Off: none of the three.
        idempotency_window: Seconds a retry key is remembered per caller. A
            SendMessage is keyed when its call asks (it names the idempotency
            extension in ``a2a-extensions`` or sends ``idempotency-key``
            metadata; see ``idempotency_every_request``): a request with the
            same key and body within the window runs nothing again and is
            answered the first one's task; another body is refused
            (MESSAGE_ID_REUSED). In cluster mode shared by every instance (the
            bucket ``A2A_KEYS``, whose max age the first instance sets). 0: off
            (the card does not declare the extension).
        idempotency_every_request: Key every SendMessage by its message id,
            asked or not: for meshes whose clients all retry with the same id
            and never reuse one for another message. Off (the default), a call
            that does not ask is run as sent, like any A2A server does. Set it
            alike on every instance of a cluster.
        idempotency_max_keys: Most message ids remembered with the in-memory
            journal (a few hundred bytes each, and message-only answers up to
            64 MiB in all). Past either bound the oldest id of the caller
            keeping the most goes: each caller keeps at least its fair share
            (the bound divided by the callers). In cluster mode, the most ids this instance's
            claims keep in the shared bucket: past it, the oldest of the
            caller that claimed the most through it is deleted.
        quota_parked_tasks: Most tasks of one principal waiting for input
            (INPUT_REQUIRED, AUTH_REQUIRED) on this instance; over it a new task
            is refused (PARKED_TASKS_QUOTA), and with the in-memory journal a
            running task that asks for input ends FAILED. In cluster mode a waiting task that
            left memory (``parked_timeout``) no longer counts. 0: no quota.
        quota_streams: Most open streams (SendStreamingMessage, SubscribeToTask)
            of one principal on this instance, waiting long-polls (GetTask with
            ``current_generation``) included; over it a new stream or poll is
            refused (STREAMS_QUOTA). 0: no quota.
        quota_subscribers: Most streams reading one task on this instance
            (its SendStreamingMessage stream and resumed streams included);
            over it a new SubscribeToTask is refused (SUBSCRIBERS_QUOTA). Apart
            from them, as many long-polls of the task may wait; one more is
            answered the task as it is, at once. 0: no quota.
        quota_push_configs: Most push configs one principal keeps, over all its
            tasks (in cluster mode, over the cluster: configs are shared, and
            count until deleted or their task's record expires, ``task_ttl``);
            over it a new config is refused (PUSH_CONFIGS_QUOTA). A config is
            at most about 11 KB (its URL, token and credentials are bounded),
            so this bounds a principal's configs to about 11 MB. 0: no quota.
        quota_push_in_flight: Most webhook requests one principal's tasks have
            in flight at once on this instance (of ``push_max_in_flight``); its
            other deliveries wait their turn, so webhooks that hang (each
            request holds its slot up to ``push_timeout``) delay its own pushes
            first. The anonymous principal (no authenticator) is not held to
            it: it is the whole instance. 0: no quota.
        max_live_tasks: Most live tasks on this instance, all principals
            together (LIVE_TASKS_LIMIT); once half are taken, a principal gets
            no more than a fair share (LIVE_TASKS_FAIR_SHARE: see "Share an
            instance between callers" in docs/how-to/limits.md). 0: no limit.
        max_streams: Most open streams on this instance, all principals
            together, waiting long-polls included (STREAMS_LIMIT), shared
            fairly the same way (STREAMS_FAIR_SHARE). 0: no limit.
        grpc_max_concurrent_streams: Most calls in flight on one client
            connection (HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``); the client
            queues the others.
        grpc_keepalive_time: Seconds of silence on a connection after which the
            server pings the client (finds dead peers of long streams).
        grpc_keepalive_timeout: Seconds the server waits for that ping's answer
            before it closes the connection.
        grpc_min_ping_interval: Least seconds between a client's keepalive pings
            the server tolerates (more often, repeatedly: the connection is
            closed with ``too_many_pings``). Clients must ping no more often.
        grpc_max_connection_idle: Seconds a connection with no call in flight
            stays open (the client reconnects when it needs to). 0: forever.
        grpc_max_connection_age: Seconds after which a connection is told to go
            away (GOAWAY: new calls go to a new connection, so load balancers
            rebalance). 0: never (the default: meshes balance per call).
        grpc_max_connection_age_grace: Seconds calls in flight get after that
            GOAWAY before they are cut (a stream cut that way is resumed with
            the resume extension, or resubscribed).
        http_trusted_proxies: Addresses and networks (CIDR, ``10.0.0.0/8``) of
            proxies in front of the HTTP port (the card and the metrics). A
            connection from one is not held to the per-address bound; each
            request's client is the right-most ``X-Forwarded-For`` entry that
            is not a listed proxy, and gets its own share of connections. The
            proxy must append the address it saw. Empty: ``X-Forwarded-For`` is
            ignored and every proxy is one client. IPv4-mapped entries
            (``::ffff:10.0.0.0/104``) are read as IPv4; a network of every
            address (``0.0.0.0/0``) is warned about at start.
    """

    log_max_frames: int = 16_384
    log_max_bytes: int = 16 * 1024 * 1024
    log_total_bytes: int = 256 * 1024 * 1024
    resume_window: float = 60.0
    event_queue_size: int = 1024
    event_queue_bytes: int = 8 * 1024 * 1024
    cancel_timeout: float = 3.0
    max_final_tasks: int = 10_000
    final_task_ttl: float = 3600.0
    max_final_bytes: int = 512 * 1024 * 1024
    max_message_bytes: int = DEFAULT_MAX_TASK_BYTES // 2
    max_task_bytes: int = DEFAULT_MAX_TASK_BYTES
    max_parts: int = 1000
    parked_timeout: float = 300.0
    max_parked_tasks: int = 10_000
    shutdown_drain: float = 0.0
    shutdown_grace: float = 10.0
    shutdown_timeout: float = 20.0
    shutdown_flush: float = 2.0
    loop_slice: float = 0.005
    push: bool = True
    push_max_configs: int = 10
    push_timeout: float = 10.0
    push_retry_for: float = 600.0
    push_max_in_flight: int = 64
    push_allow_private: bool = False
    push_allow_hosts: tuple[str, ...] = ()
    push_ca_file: str = ""
    generation: bool = True
    idempotency_window: float = 86_400.0
    idempotency_every_request: bool = False
    idempotency_max_keys: int = 100_000
    quota_live_tasks: int = 1000
    quota_parked_tasks: int = 1000
    quota_streams: int = 1000
    quota_subscribers: int = 256
    quota_push_configs: int = 1000
    quota_push_in_flight: int = 32
    max_live_tasks: int = 10_000
    max_streams: int = 10_000
    grpc_max_concurrent_streams: int = 1000
    grpc_keepalive_time: float = 60.0
    grpc_keepalive_timeout: float = 20.0
    grpc_min_ping_interval: float = 10.0
    grpc_max_connection_idle: float = 900.0
    grpc_max_connection_age: float = 0.0
    grpc_max_connection_age_grace: float = 300.0
    http_trusted_proxies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "http_trusted_proxies", tuple(self.http_trusted_proxies))
        for proxy in self.http_trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"http_trusted_proxies: {proxy!r} is not an IP address or network (CIDR)"
                ) from None
        if self.log_max_frames < 1 or self.log_max_bytes < 1:
            raise ValueError("log_max_frames and log_max_bytes must be positive")
        if self.log_total_bytes < self.log_max_bytes:
            raise ValueError("log_total_bytes must be at least log_max_bytes")
        if self.resume_window < 0:
            raise ValueError("resume_window must not be negative")
        if self.event_queue_size < 1 or self.event_queue_bytes < 1:
            raise ValueError("event_queue_size and event_queue_bytes must be positive")
        if self.idempotency_window < 0 or self.idempotency_max_keys < 1:
            raise ValueError(
                "idempotency_window must not be negative and idempotency_max_keys positive"
            )
        if self.cancel_timeout <= 0:
            raise ValueError("cancel_timeout must be positive")
        if self.max_final_tasks < 0 or self.final_task_ttl < 0 or self.max_final_bytes < 0:
            raise ValueError("retention limits must not be negative")
        if self.parked_timeout <= 0 or self.max_parked_tasks < 1:
            raise ValueError("parked_timeout and max_parked_tasks must be positive")
        if not 0 < self.shutdown_flush < self.shutdown_timeout or self.shutdown_grace < 0:
            raise ValueError(
                "shutdown_flush must be positive and below shutdown_timeout, "
                "and shutdown_grace not negative"
            )
        if self.shutdown_drain < 0:
            raise ValueError("shutdown_drain must not be negative")
        if self.loop_slice < 0:
            raise ValueError("loop_slice must not be negative")
        if self.push_max_configs < 1 or self.push_max_in_flight < 1:
            raise ValueError("push_max_configs and push_max_in_flight must be positive")
        if self.push_timeout <= 0 or self.push_retry_for < 0:
            raise ValueError("push_timeout must be positive and push_retry_for not negative")
        quotas = (
            self.quota_live_tasks,
            self.quota_parked_tasks,
            self.quota_streams,
            self.quota_subscribers,
            self.quota_push_configs,
            self.quota_push_in_flight,
            self.max_live_tasks,
            self.max_streams,
        )
        if min(quotas) < 0:
            raise ValueError("quotas must not be negative (0: no quota)")
        if self.grpc_max_concurrent_streams < 1:
            raise ValueError("grpc_max_concurrent_streams must be positive")
        timings = (
            self.grpc_keepalive_time,
            self.grpc_keepalive_timeout,
            self.grpc_min_ping_interval,
            self.grpc_max_connection_idle,
            self.grpc_max_connection_age,
            self.grpc_max_connection_age_grace,
        )
        if min(timings) < 0 or self.grpc_keepalive_time == 0:
            raise ValueError(
                "gRPC transport durations must not be negative, and grpc_keepalive_time "
                "must be positive"
            )
        if self.max_message_bytes < 1 or self.max_message_bytes * 2 > self.max_task_bytes:
            raise ValueError(
                f"max_message_bytes ({self.max_message_bytes}) must be positive and at most "
                f"half of max_task_bytes ({self.max_task_bytes})"
            )

    def fitted(self, record_bytes: int | None) -> ServerConfig:
        """These settings with the size limits lowered to what a record can hold.

        Args:
            record_bytes: The largest task the journal's backend stores (None:
                no limit of its own).

        Returns:
            ``self`` if it fits; else a copy with ``max_task_bytes`` lowered to
            ``record_bytes`` and ``max_message_bytes`` to at most half of that.
        """
        if record_bytes is None or record_bytes >= self.max_task_bytes:
            return self
        return replace(
            self,
            max_task_bytes=record_bytes,
            max_message_bytes=min(self.max_message_bytes, record_bytes // 2),
        )
