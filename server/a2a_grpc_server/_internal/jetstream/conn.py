"""The NATS connection of one instance, and the JetStream assets every instance shares.

Assets (created if missing, identical on every instance):

* stream ``A2A_EVENTS`` on ``a2a.events.<task id>``: the record of every
  task, one message per change (see ``journal``), bounded by age, messages
  per task and bytes (oldest dropped first); direct gets allowed, so a task's
  changes after a snapshot are read in one request (NATS Server 2.11 or newer);
  with ``event_streams`` above 1, also ``A2A_EVENTS_<k>`` on
  ``a2a.ev.<k>.<task id>`` (the same limits each), k = 1 …;
* KV bucket ``A2A_TASKS``: a snapshot per task (history 1, max age
  ``task_ttl``), so reading a task costs a snapshot plus a few changes;
* KV bucket ``A2A_INSTANCES``: one heartbeat key per live instance;
* KV bucket ``A2A_PUSH``: push configs and their cursors (see ``pushstore``),
  max age ``task_ttl``;
* KV bucket ``A2A_PUSH_CALLERS``: which principal each push config counts
  against (``quota_push_configs``; see ``pushstore``), max age ``task_ttl``;
* KV bucket ``A2A_KEYS`` (made at the first SendMessage, see ``keys``): the
  message ids sent, max age ``idempotency_window``;
* stream ``A2A_INDEX`` on ``a2a.idx.>``: the listing index (see ``index``),
  max age ``task_ttl``, direct gets allowed.

Control requests between instances use core NATS request/reply on
``a2a.ctl.<instance id>.<op>``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client, ServerVersion
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from .natsconfig import NatsConfig as NatsConfig
from .natsconfig import without_userinfo

logger = logging.getLogger(__name__.replace("._internal", ""))

TASKS_BUCKET = "A2A_TASKS"
INSTANCES_BUCKET = "A2A_INSTANCES"
PUSH_BUCKET = "A2A_PUSH"
PUSH_CALLERS_BUCKET = "A2A_PUSH_CALLERS"
KEYS_BUCKET = "A2A_KEYS"
EVENTS_STREAM = "A2A_EVENTS"
EVENTS_SUBJECT = "a2a.events"
SHARD_SUBJECT = "a2a.ev"
"""Event stream k >= 1 (``A2A_EVENTS_<k>``) carries ``a2a.ev.<k>.<task id>``."""


def events_stream(shard: int) -> str:
    """The name of event stream ``shard`` (0: ``A2A_EVENTS``, as before there were more)."""
    return EVENTS_STREAM if shard == 0 else f"{EVENTS_STREAM}_{shard}"


def events_subjects(shard: int) -> str:
    """The subjects event stream ``shard`` takes (a prefix of each task's subject)."""
    return EVENTS_SUBJECT if shard == 0 else f"{SHARD_SUBJECT}.{shard}"


LOG_STREAM = "A2A_LOG"
LOG_SUBJECT = "a2a.log"
CURRENT_STREAM = "A2A_CURRENT"
CURRENT_SUBJECT = "a2a.cur"
INDEX_STREAM = "A2A_INDEX"
INDEX_SUBJECT = "a2a.idx"
CONTROL_SUBJECT = "a2a.ctl"
SETUP_TIMEOUT = 20.0
CONNECT_ATTEMPTS = 3
CONNECT_TIMEOUT = 2.0
"""Tries per server URL before the first connect gives up."""
INSTANCES_TTL = 3600.0
"""Seconds a lost instance's heartbeat key lingers (harmless: survivors judge by freshness)."""
IN_USE = 10058
"""JetStream: a stream of that name exists with a different configuration."""
JETSTREAM_NOT_READY = (10005, 10008, 10023)
"""JetStream error codes that mean "not ready yet" while a cluster forms (10005: no
suitable peers for placement, before every node has joined); setup waits them out."""


@dataclass
class NatsConnection:
    """An open connection and the shared assets."""

    config: NatsConfig
    nc: Client
    js: JetStreamContext
    tasks: KeyValue
    instances: KeyValue
    push: KeyValue
    push_callers: KeyValue
    events: ConnectionEvents = field(default_factory=lambda: ConnectionEvents())

    async def close(self) -> None:
        """Flush what is buffered (bounded), then close the connection."""
        if self.nc.is_closed:
            return
        self.events.closing = True
        try:
            await self.nc.flush(timeout=2)
        except (nats.errors.Error, TimeoutError) as exc:
            logger.warning("closing NATS without a flush: %s", type(exc).__name__)
        await self.nc.close()


async def connect(config: NatsConfig) -> NatsConnection:
    """Connect, then create or check the shared assets (waits for JetStream to be ready).

    Raises:
        ConnectionError: NATS or JetStream did not become available within 20 s, it
            refused the credentials, or a credentials or TLS file cannot be used.
    """
    name = f"a2a-grpc-server {config.instance_id}"
    events = ConnectionEvents()
    try:
        options = _auth_options(config)
    except (ValueError, OSError, ssl.SSLError) as exc:
        raise ConnectionError(f"cannot connect to NATS: {exc}") from None
    errors: list[Exception] = []
    connecting = True

    async def on_error(exc: Exception) -> None:  # (what the first connect met is reported)
        if connecting:
            errors.append(exc)
        await _log_error(exc)

    # nats-py can hang after a failed TLS handshake: the first connect is bounded here too.
    bound = (CONNECT_TIMEOUT + 0.5) * CONNECT_ATTEMPTS * len(config.servers) + 2.0
    try:
        async with asyncio.timeout(bound):
            nc = await _connect(config, name, options, events, on_error)
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        raise ConnectionError(_why_not(config, [*errors, exc])) from exc
    connecting = False  # (later errors are logged only)
    too_old = server_too_old(nc.connected_server_version)
    if too_old is not None:
        events.closing = True  # (its disconnect is ours, not a loss)
        await nc.close()
        raise ConnectionError(too_old)
    nc.options["max_reconnect_attempts"] = -1
    js = nc.jetstream(timeout=5)
    try:
        async with asyncio.timeout(SETUP_TIMEOUT):
            tasks, instances, push, push_callers = await _ensure_assets(js, config)
    except TimeoutError as exc:
        await nc.close()
        raise ConnectionError("JetStream did not become available within 20 s") from exc
    except BaseException:
        await nc.close()  # whatever went wrong, no connection is left behind
        raise
    return NatsConnection(config, nc, js, tasks, instances, push, push_callers, events)


async def _connect(
    config: NatsConfig,
    name: str,
    options: dict[str, Any],
    events: ConnectionEvents,
    error_cb: Callable[[Exception], Awaitable[None]],
) -> Client:
    arguments: dict[str, Any] = {
        **options,
        "connect_timeout": CONNECT_TIMEOUT,  # (seconds: nats-py takes a float, types an int)
        "reconnect_time_wait": 0.25,
        # A bounded first connect (a wrong URL fails fast); once connected,
        # reconnect forever (see ``connect``): NATS failing over must not stop us.
        "max_reconnect_attempts": CONNECT_ATTEMPTS,
        "allow_reconnect": True,
        "error_cb": error_cb,
        "disconnected_cb": events.disconnected,
        "reconnected_cb": events.reconnected,
    }
    nc = Client()
    await nc.connect(servers=config.servers, name=name, **arguments)
    return nc


def _auth_options(config: NatsConfig) -> dict[str, Any]:
    """The ``nats.connect`` arguments of ``config``'s credentials and TLS.

    Raises:
        ValueError: A file cannot be read, or the credentials need ``nkeys``.
    """
    options: dict[str, Any] = {}
    if config.creds_file or config.nkey_seed_file:
        if importlib.util.find_spec("nkeys") is None:  # (nats-py needs it for both)
            raise ValueError(
                "nats_creds_file and nats_nkey_seed_file need the nkeys package (pip install nkeys)"
            ) from None
        if config.creds_file:
            options["user_credentials"] = _readable(config.creds_file)
        if config.nkey_seed_file:
            options["nkeys_seed"] = _readable(config.nkey_seed_file)
    if config.token_file:
        options["token"] = _secret(config.token_file)
    if config.user:
        options["user"] = config.user
        options["password"] = _secret(config.password_file) if config.password_file else ""
    if config.tls_ca or config.tls_cert:
        context = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert:
            context.load_cert_chain(config.tls_cert, config.tls_key)
        options["tls"] = context
    return options


def _readable(path: str) -> str:
    try:
        with open(path, "rb"):
            return path
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None


def _secret(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().strip()
    except OSError as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None


async def _ensure_assets(
    js: JetStreamContext, config: NatsConfig
) -> tuple[KeyValue, KeyValue, KeyValue, KeyValue]:
    while True:
        try:
            tasks = await ensure_kv(js, TASKS_BUCKET, config.task_ttl, config.replicas)
            instances = await ensure_kv(js, INSTANCES_BUCKET, INSTANCES_TTL, config.replicas)
            push = await ensure_kv(js, PUSH_BUCKET, config.task_ttl, config.replicas)
            callers = await ensure_kv(js, PUSH_CALLERS_BUCKET, config.task_ttl, config.replicas)
            for shard in range(config.event_streams):
                await _ensure_events(js, config, shard)
            await _ensure_index(js, config)
            await _ensure_log(js, config)
            return tasks, instances, push, callers
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError) as exc:
            logger.info("waiting for JetStream: %s", type(exc).__name__)
        except nats.js.errors.APIError as exc:
            if exc.code != 503 and exc.err_code not in JETSTREAM_NOT_READY:
                raise
            logger.info("waiting for JetStream: %s", exc.description)
        await asyncio.sleep(0.25)  # JetStream elects its meta leader


async def ensure_kv(js: JetStreamContext, bucket: str, ttl: float, replicas: int) -> KeyValue:
    """The KV ``bucket``, created with max age ``ttl`` if it does not exist."""
    try:
        return await js.create_key_value(
            bucket=bucket,
            history=1,
            ttl=ttl,
            replicas=replicas,
            direct=False,
            storage=api.StorageType.FILE,
        )
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != IN_USE:
            raise
        # The first instance's settings stand; every instance then agrees.
        logger.warning("bucket %s exists with other settings; using it as it is", bucket)
        return await js.key_value(bucket)


async def _ensure_events(js: JetStreamContext, config: NatsConfig, shard: int) -> None:
    name = events_stream(shard)
    stream = api.StreamConfig(
        name=name,
        subjects=[f"{events_subjects(shard)}.>"],
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.OLD,
        max_age=config.events_ttl,
        max_msgs_per_subject=config.events_per_task,
        max_bytes=config.events_max_bytes,
        num_replicas=config.replicas,
        storage=api.StorageType.FILE,
        duplicate_window=min(120.0, config.events_ttl),
        allow_direct=True,
    )
    try:
        await js.add_stream(stream)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != IN_USE:
            raise
        # The first instance's limits stand; the features every instance needs are added.
        existing = (await js.stream_info(name)).config
        if not existing.allow_direct:
            existing.allow_direct = True
            await js.update_stream(existing)
        logger.warning("stream %s exists with other settings; using it as it is", name)


async def _ensure_index(js: JetStreamContext, config: NatsConfig) -> None:
    stream = api.StreamConfig(
        name=INDEX_STREAM,
        subjects=[f"{INDEX_SUBJECT}.>"],
        retention=api.RetentionPolicy.LIMITS,
        discard=api.DiscardPolicy.OLD,
        max_age=config.task_ttl,
        num_replicas=config.replicas,
        storage=api.StorageType.FILE,
        allow_direct=True,
        allow_rollup_hdrs=True,
    )
    try:
        await js.add_stream(stream)
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != IN_USE:
            raise
        logger.warning("stream %s exists with other settings; using it as it is", INDEX_STREAM)


def log_config(replicas: int = 1, max_age: float = 0.0) -> api.StreamConfig:
    """The task log's stream (``tasklog``): direct gets, per-message TTLs allowed, file storage."""
    return api.StreamConfig(
        name=LOG_STREAM,
        subjects=[f"{LOG_SUBJECT}.>"],
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age or None,
        allow_direct=True,
        allow_msg_ttl=True,
    )


def current_config(replicas: int = 1, max_age: float = 0.0) -> api.StreamConfig:
    """The task log's listing index: its ``s`` and ``f``, one entry per task (``tasklog``).

    A transform's ``{{wildcard(n)}}`` is the n-th ``*`` of its source filter
    ``a2a.log.t.*.*.*.*.<kind>``: 1 the task, 3 the scope, 4 the context.
    """
    dest = f"{CURRENT_SUBJECT}.{{{{wildcard(3)}}}}.{{{{wildcard(4)}}}}.{{{{wildcard(1)}}}}"
    transforms = [
        api.SubjectTransform(src=f"{LOG_SUBJECT}.t.*.*.*.*.{kind}", dest=dest) for kind in "sf"
    ]
    return api.StreamConfig(
        name=CURRENT_STREAM,
        sources=[api.StreamSource(name=LOG_STREAM, subject_transforms=transforms)],
        storage=api.StorageType.FILE,
        num_replicas=replicas,
        max_age=max_age or None,
        max_msgs_per_subject=1,
        allow_direct=True,
    )


async def _ensure_log(js: JetStreamContext, config: NatsConfig) -> None:
    """Make the task log of format 3 and its index (``tasklog``).

    Every instance that reads them makes them, so one asked to write finds them
    (an older version ignores them).
    """
    for stream in (
        log_config(config.replicas, config.task_ttl),
        current_config(config.replicas, config.task_ttl),
    ):
        try:
            await js.add_stream(stream)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != IN_USE:
                raise
            logger.warning("stream %s exists with other settings; using it as it is", stream.name)


OLDEST_SERVER = (2, 11)
"""The oldest nats-server cluster mode works with: it reads with batched direct gets
(``batch``, ``multi_last``, ``Nats-Num-Pending``), new in 2.11; an older one ignores
what it does not know in a request, so its answers would be quietly wrong."""


def server_too_old(version: ServerVersion) -> str | None:
    """Why cluster mode cannot use the nats-server of ``version`` (None: it can)."""
    shown = str(version).removeprefix("<nats server v").removesuffix(">")
    try:
        found = (version.major, version.minor)
    except ValueError:
        found = (0, 0)
    if found == (0, 0):  # (nats-py's "0.0.0-unknown": the server said none)
        return f"nats-server says its version is {shown!r}, which cluster mode cannot read"
    if found >= OLDEST_SERVER:
        return None
    oldest = ".".join(str(n) for n in OLDEST_SERVER)
    return (
        f"nats-server {found[0]}.{found[1]} is older than {oldest}, the oldest cluster mode "
        f"works with (it reads with batched direct gets); upgrade the NATS servers"
    )


def _why_not(config: NatsConfig, errors: list[Exception]) -> str:
    """Why the first connect failed, as an operator can act on it."""
    where = ", ".join(without_userinfo(url) for url in config.servers)  # (logged)
    texts = [f"{type(e).__name__}: {e}" for e in errors]
    if any("authorization" in t.lower() or "authentication" in t.lower() for t in texts):
        return (
            f"NATS at {where} refused this instance's credentials; check nats_creds_file, "
            "nats_nkey_seed_file, nats_token_file, nats_user and nats_password_file"
        )
    if any("certificate" in t.lower() or "ssl" in t.lower() for t in texts):
        return (
            f"cannot connect to NATS at {where}: TLS failed ({texts[0]}); check nats_tls_ca "
            "(the CA of the NATS servers' certificates) and the URL's host"
        )
    return f"cannot connect to NATS at {where}"


async def _log_error(exc: Exception) -> None:
    logger.warning("NATS: %s: %s", type(exc).__name__, exc)


class ConnectionEvents:
    """Logs the connection's comings and goings: a loss as a warning, a close of ours as info."""

    def __init__(self) -> None:
        self.closing = False
        """This instance is closing the connection itself (its shutdown)."""

    async def disconnected(self) -> None:
        """nats-py lost (or closed) the connection."""
        if self.closing:
            logger.info("disconnected from NATS (shutting down)")
        else:
            logger.warning("disconnected from NATS")

    async def reconnected(self) -> None:
        """nats-py connected again."""
        logger.warning("reconnected to NATS")
