"""Lifecycle: the embeddable service, and the standalone server around it.

``A2AService`` is what a team adds to its own ``grpc.aio`` server: the
servicer plus the task engine, with ``start()`` (joins the cluster, if
any) and ``shutdown(grace)`` to end its tasks with a final frame.
``A2AServer`` is the whole process: gRPC (A2A, health, reflection) and the
HTTP agent card, with ``start()`` / ``stop(grace)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from types import TracebackType
from typing import TYPE_CHECKING, Protocol

import grpc
from a2a.server.agent_execution import AgentExecutor
from a2a.types import a2a_pb2
from a2a.types.a2a_pb2 import AgentCard
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from ..cluster import Cluster, Local
from ..cluster.front import ClusterFront
from ..config import DEFAULT_MAX_TASK_BYTES, ServerConfig
from ..engine.engine import TaskEngine
from ..engine.ports import TaskOperations
from ..engine.registry import LiveTasks
from ..journal import TaskJournal
from ..journal.keys import MemorySentKeys, SentKeys
from ..journal.memory import MemoryJournal
from ..obs.metrics import Metrics
from ..push.service import PushService
from ..rpc import idempotency
from ..rpc import servicer as rpc
from ..rpc.auth import Authenticator, AuthInterceptor, declared_scheme
from ..rpc.closing import Closing
from ..rpc.idempotency import Retries
from ..rpc.metrics import MetricsInterceptor, RpcMetrics
from ..rpc.resume import extension as resume_extension
from ..rpc.servicer import RpcServicer
from ..rpc.tracing import server_spans
from .card import (
    WELL_KNOWN_PATH,
    default_card,
    with_capabilities,
    with_extended_card,
    with_extension,
    with_grpc_endpoint,
    with_security,
)
from .collector import A2ACollector
from .http import Fixed, HttpServer, Live, Route
from .tls import CertificateWatch, TlsFiles, is_loopback

if TYPE_CHECKING:
    from ..jetstream.conn import NatsConfig
    from ..push.configs import PushConfigStore

logger = logging.getLogger(__name__.replace("._internal", ""))

SERVICE_NAME = a2a_pb2.DESCRIPTOR.services_by_name["A2AService"].full_name


ANSWER_SLACK = 64 * 1024
"""Bytes an answer may take beyond ``max_task_bytes`` (a ListTasks page's own fields,
a frame's resume tag)."""


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """The options a ``grpc.aio`` server serving ``config`` needs: sizes and transport.

    Requests up to twice ``max_message_bytes`` reach the server's validation
    (and get INVALID_ARGUMENT saying what is accepted, not a bare
    RESOURCE_EXHAUSTED); answers go up to ``max_task_bytes`` plus slack,
    which every answer fits (see ``ServerConfig.max_task_bytes``). Clients
    that read large tasks raise their own receive limit to match (gRPC's
    default is 4 MiB). The transport options are the ``grpc_*`` settings.
    """
    options = [
        ("grpc.max_receive_message_length", 2 * config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_task_bytes + ANSWER_SLACK),
        ("grpc.max_concurrent_streams", config.grpc_max_concurrent_streams),
        ("grpc.keepalive_time_ms", _ms(config.grpc_keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(config.grpc_keepalive_timeout)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(config.grpc_min_ping_interval)),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if config.grpc_max_connection_idle:
        options.append(("grpc.max_connection_idle_ms", _ms(config.grpc_max_connection_idle)))
    if config.grpc_max_connection_age:
        options.append(("grpc.max_connection_age_ms", _ms(config.grpc_max_connection_age)))
        options.append(
            ("grpc.max_connection_age_grace_ms", _ms(config.grpc_max_connection_age_grace))
        )
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class ClusterMember(Cluster, Protocol):
    """A cluster the service runs in: ``Cluster``, and the push config store it shares."""

    @property
    def push_store(self) -> PushConfigStore:
        """Push configs and their cursors, shared by every instance."""
        ...

    def sent_keys(self, window: float, most: int) -> SentKeys:
        """The message ids sent, shared by every instance, kept ``window`` seconds.

        ``most``: most keys this instance's claims keep (``idempotency_max_keys``).
        """
        ...


class A2AService:
    """The A2A service for an existing ``grpc.aio`` server.

    Args:
        executor: The agent (an a2a-sdk ``AgentExecutor``).
        card: The agent card; a default one if None. The resume extension is
            added to its ``capabilities.extensions``.
        config: Limits.
        journal: Where tasks are recorded; the cluster's, or in memory with
            ``config``'s retention, if None. Its type is the implementation's:
            leave it None (the tests pass stores of their own).
        extended_card: Card GetExtendedAgentCard gives authenticated callers, if
            any (the public card then says so in its capabilities).
        cluster: The ``NatsCluster`` this instance joins at ``start()`` (None:
            alone). Any object of the implementation's ``ClusterMember`` port.
    """

    def __init__(
        self,
        executor: AgentExecutor,
        card: AgentCard | None = None,
        *,
        config: ServerConfig | None = None,
        journal: TaskJournal | None = None,
        extended_card: AgentCard | None = None,
        cluster: ClusterMember | None = None,
    ) -> None:
        wanted = config or ServerConfig()
        self.config = wanted.fitted(cluster.max_record_bytes if cluster is not None else None)
        if self.config is not wanted:
            # At nats-server's default max_payload (1 MiB) this happens to every instance
            # left at the default sizes: nothing to act on unless larger tasks are needed
            # (INFO). Sizes someone set and did not get are worth a WARNING.
            asked = (wanted.max_task_bytes, wanted.max_message_bytes)
            defaults = (DEFAULT_MAX_TASK_BYTES, DEFAULT_MAX_TASK_BYTES // 2)
            logger.log(
                logging.INFO if asked == defaults else logging.WARNING,
                "cluster mode: a task is kept in one NATS message, so tasks are limited to %d "
                "bytes and requests to %d (asked: %d and %d) by the NATS servers' max_payload; "
                "for larger tasks raise max_payload in the nats-server configuration (up to "
                "64 MiB; see docs/how-to/troubleshooting.md)",
                self.config.max_task_bytes,
                self.config.max_message_bytes,
                wanted.max_task_bytes,
                wanted.max_message_bytes,
            )
        if self.config.push and card is not None and _says_no_push(card):
            logger.info(
                "push notifications are off: the agent's card says it sends none "
                "(capabilities.push_notifications is false)"
            )
            self.config = dataclasses.replace(self.config, push=False)
        push = self.config.push
        card = with_extension(card or default_card(), resume_extension(self.config.resume_window))
        window = self.config.idempotency_window
        if window:
            every = self.config.idempotency_every_request
            card = with_extension(card, idempotency.extension(window, every))
        self.card = with_capabilities(card, push_notifications=push)
        if extended_card is not None:
            self.card = with_extended_card(self.card)
        self.cluster = cluster
        self.journal: TaskJournal
        if journal is not None:
            self.journal = journal
        elif cluster is not None:
            self.journal = cluster.journal
        else:
            self.journal = MemoryJournal(
                self.config.max_final_tasks,
                self.config.final_task_ttl,
                max_final_bytes=self.config.max_final_bytes,
            )
        self.metrics = Metrics()
        self.rpc_metrics = RpcMetrics()
        """Per-RPC counts, kept by ``metrics_interceptor()`` on the server it is added to."""
        tasks = LiveTasks(
            self.journal,
            self.config,
            self.metrics,
            instance_id=cluster.instance_id if cluster is not None else None,
        )
        self.push: PushService | None = None
        """Push notifications (None: push is off)."""
        if push:
            store = cluster.push_store if cluster is not None else None
            self.push = PushService(tasks, self.config, self.metrics, store, cluster)
            if isinstance(self.journal, MemoryJournal):
                self.journal.on_forget = self.push.forgotten
        self.engine = TaskEngine(executor, tasks, push=self.push)
        """The operations on this instance's own tasks."""
        self.operations: TaskOperations = (
            ClusterFront(self.engine, cluster) if cluster is not None else self.engine
        )
        """What the servicer asks of tasks (the engine alone, or the cluster front)."""
        self.closing = Closing(self.rpc_metrics)
        """How new calls are held, then refused, while the gRPC server closes."""
        self.servicer = RpcServicer(
            self.engine,
            self.config,
            self.card,
            extended_card,
            self.operations,
            self.push,
            self.closing,
            Retries(self._sent_keys(cluster), self.config.idempotency_every_request),
        )

    def _sent_keys(self, cluster: ClusterMember | None) -> SentKeys | None:
        """Where message ids are kept (see ``rpc.idempotency``; None: not kept)."""
        window = self.config.idempotency_window
        if not window:
            return None
        if cluster is not None:
            return cluster.sent_keys(window, self.config.idempotency_max_keys)
        return MemorySentKeys(window, self.config.idempotency_max_keys)

    async def start(self) -> None:
        """Join the cluster (no-op for a single instance); call before serving."""
        if self.cluster is not None:
            engine = self.engine
            await self.cluster.join(
                Local(engine, engine.tasks, engine.recheck_ownership, self.push)
            )

    async def wait_idle(self) -> None:
        """Wait until no run, stream or relay cleanup of this service is alive."""
        await self.servicer.wait_streams_closed()
        await self.engine.wait_idle()
        if self.cluster is not None:
            await self.cluster.wait_idle()

    def collector(self, auth: Authenticator | None = None) -> Collector:
        """This service's metrics, for a ``prometheus_client`` registry (see ``collector``).

        ``auth``: the server's authenticator, for its credential gauges.
        """
        return A2ACollector(self.metrics, self.rpc_metrics, self.engine.tasks.pool, auth)

    def metrics_interceptor(self) -> grpc.aio.ServerInterceptor:
        """The interceptor that counts every call (first among the server's interceptors)."""
        return MetricsInterceptor(self.rpc_metrics)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The interceptors a server of this service wants: one, counting then tracing.

        Add an ``auth.AuthInterceptor`` after it, if any.
        """
        return [MetricsInterceptor(self.rpc_metrics, inner=server_spans(self.card))]

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the A2A servicer on ``server`` (made with ``grpc_options(config)``)."""
        rpc.add_to_server(self.servicer, server)

    async def shutdown(self, grace: float | None = None, within: float | None = None) -> None:
        """Refuse new work, give running tasks ``grace`` seconds, then end them FAILED.

        Every open stream receives its final frame before this returns (in
        cluster mode, streams relayed from other instances end UNAVAILABLE
        RELAY_LOST, and this instance then leaves the cluster). In cluster
        mode a task that waits for input is not ended: it is left to the
        cluster (any instance continues it), and its streams here end
        UNAVAILABLE TASK_HANDED_OVER, to resubscribe through another instance.

        Args:
            grace: Seconds runs may take to finish (default ``shutdown_grace``).
            within: Seconds this takes at most (default: ``shutdown_timeout``
                less ``shutdown_flush``, what the transport gets afterwards).
        """
        config = self.config
        if within is None:
            within = config.shutdown_timeout - config.shutdown_flush
        deadline = asyncio.get_running_loop().time() + within
        await self.engine.shutdown(
            config.shutdown_grace if grace is None else grace,
            deadline=deadline,
            release=self.cluster.release if self.cluster is not None else None,
        )
        if self.cluster is not None:
            await self.cluster.leave()


TAKE_SETTLE = 0.05
"""Seconds a closing server waits, once quiet, for calls grpc core received to be taken."""
GOAWAY_SETTLE = 0.1
"""Seconds between the gRPC server's stop (its GOAWAY) and refusing the calls held meanwhile:
time for clients to read the GOAWAY, so their retries take a new connection."""

CHANNELZ = "grpc.channelz.v1.Channelz"
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
"""Bind addresses that mean every interface (not an address a client can use)."""


def _add_channelz(server: grpc.aio.Server) -> None:
    """Serve channelz on ``server``.

    Raises:
        ValueError: grpcio-channelz is not installed.
    """
    try:
        from grpc_channelz.v1 import channelz
    except ImportError as exc:
        raise ValueError(f"--admin needs the admin extra (pip install '.[admin]'): {exc}") from None
    channelz.add_channelz_servicer(server)  # type: ignore[no-untyped-call]


def _says_no_push(card: AgentCard) -> bool:
    """Whether the agent's own card says, explicitly, that it sends no push notifications."""
    capabilities = card.capabilities
    return capabilities.HasField("push_notifications") and not capabilities.push_notifications


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _add_reflection(services: list[str], server: grpc.aio.Server) -> None:
    """Serve gRPC reflection as ``v1`` (what grpcurl and current tools ask first) and ``v1alpha``.

    grpcio-reflection serves only ``v1alpha``; ``v1``'s messages are the same
    on the wire (same fields, same numbers), so one servicer answers both.
    """
    servicer = reflection.aio.ReflectionServicer(services)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    method = grpc.stream_stream_rpc_method_handler(  # type: ignore[no-untyped-call]
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method}),)  # type: ignore[no-untyped-call]
    )


def metrics_registry(service: A2AService, auth: Authenticator | None = None) -> CollectorRegistry:
    """A registry of ``service``'s metrics and this process's (CPU, memory, GC, Python)."""
    registry = CollectorRegistry()
    registry.register(service.collector(auth))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class A2AServer:
    """A standalone server: A2A + health + reflection over gRPC; card and metrics over HTTP.

    Args:
        executor: The agent.
        card: The agent card (its gRPC interface is filled in at start).
        host: Address to bind both servers to.
        port: gRPC port (0 for any free port).
        http_port: Agent-card HTTP port (0 for any free port, None for none).
        config: Limits.
        journal: Where tasks are recorded (in memory if None). Its type is the
            implementation's: leave it None (the tests pass stores of their own).
        nats: Join a cluster on NATS JetStream with this configuration.
        tls: Serve TLS (mTLS with a client CA) on both ports, certificates
            re-read when their files change (see ``tls``); None: plaintext.
        auth: Authenticate every A2A call with this (see ``auth``); the card
            then declares its scheme. None: every caller is anonymous.
        extended_card: The card GetExtendedAgentCard gives authenticated callers.
        admin: Also serve gRPC channelz (``grpc.channelz.v1.Channelz``: channels,
            sockets, call counts) for debugging; authenticated like the A2A
            service when ``auth`` is given. Needs the ``admin`` extra.
        advertise: The gRPC address clients should use (``HOST:PORT``), put in
            the agent card (None: the bind address, or for a wildcard bind
            such as 0.0.0.0 this host's name and the port).
    """

    def __init__(
        self,
        executor: AgentExecutor,
        card: AgentCard | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 50051,
        http_port: int | None = 8080,
        config: ServerConfig | None = None,
        journal: TaskJournal | None = None,
        nats: NatsConfig | None = None,
        tls: TlsFiles | None = None,
        auth: Authenticator | None = None,
        extended_card: AgentCard | None = None,
        admin: bool = False,
        advertise: str | None = None,
    ) -> None:
        if auth is not None:
            card = with_security(card or default_card(), *declared_scheme(auth))
        self._auth = auth
        self._executor, self._card, self._config, self._journal = executor, card, config, journal
        self._extended_card = extended_card
        self._admin = admin
        self._nats = nats
        self.certificates = CertificateWatch(tls) if tls is not None else None
        """The certificates served (None: plaintext)."""
        self.service = A2AService(
            executor, card, config=config, journal=journal, extended_card=extended_card
        )
        self._host, self._port, self._http_port = host, port, http_port
        self._advertise = advertise
        self._grpc: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._http: HttpServer | None = None
        self.grpc_port = 0
        self.http_port: int | None = None
        self.registry: CollectorRegistry | None = None
        """What ``/metrics`` serves (after ``start``; None without an HTTP port)."""

    @property
    def grpc_address(self) -> str:
        """``host:port`` of the gRPC server (after ``start``)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self.grpc_port}"

    @property
    def advertised_address(self) -> str:
        """The gRPC address the agent card gives clients (after ``start``).

        ``advertise`` if given; else the bind address, unless that is a
        wildcard (0.0.0.0, ::), which no client can connect to: then this
        host's name and the port (behind a Service, give ``--advertise``).
        """
        if self._advertise is not None:
            return self._advertise
        if self._host in WILDCARDS:
            name = socket.getfqdn()
            return f"[{name}]:{self.grpc_port}" if ":" in name else f"{name}:{self.grpc_port}"
        return self.grpc_address

    async def start(self) -> None:
        """Join the cluster (with ``nats``), bind and serve; logs one ready line.

        Raises:
            OSError: A port could not be bound, or NATS could not be reached.
        """
        if self._nats is not None:
            from ..jetstream.node import NatsCluster

            try:
                cluster = await NatsCluster.connect(self._nats)
            except ConnectionError as exc:
                raise OSError(str(exc)) from exc
            self.service = A2AService(
                self._executor,
                self._card,
                config=self._config,
                journal=self._journal,
                cluster=cluster,
                extended_card=self._extended_card,
            )
        try:
            await self.service.start()
            await self._serve()
        except BaseException:
            if self.service.cluster is not None:
                await self.service.shutdown(0)
                await self.service.cluster.close()
            raise

    async def _serve(self) -> None:
        """Start the gRPC and HTTP servers (see ``start``)."""
        server = grpc.aio.server(
            options=[
                *grpc_options(self.service.config),
                # Without this a second server silently shares the port.
                ("grpc.so_reuseport", 0),
            ],
            interceptors=[
                *self.service.interceptors(),
                *([AuthInterceptor(self._auth, (CHANNELZ,))] if self._auth is not None else []),
            ],
        )
        self.service.add_to_server(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        services = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1]
        if self._admin:
            _add_channelz(server)
            services.append(CHANNELZ)
        _add_reflection(services, server)
        host = f"[{self._host}]" if ":" in self._host else self._host
        certificates = self.certificates
        try:
            if certificates is None:
                self.grpc_port = server.add_insecure_port(f"{host}:{self._port}")
            else:
                credentials = certificates.grpc_credentials()
                self.grpc_port = server.add_secure_port(f"{host}:{self._port}", credentials)
        except RuntimeError as exc:
            raise OSError(f"cannot serve gRPC on {host}:{self._port}: {exc}") from exc
        if certificates is None and not is_loopback(self._host):
            logger.warning(
                "serving PLAINTEXT on %s, which is not a loopback address: anyone on the "
                "network can read and send A2A calls; give --tls-cert and --tls-key",
                self._host,
            )
        await server.start()
        self._grpc = server
        card = with_grpc_endpoint(self.service.card, self.advertised_address)
        if self._http_port is not None:
            registry = self.registry = metrics_registry(self.service, self._auth)
            routes: dict[str, Route] = {
                WELL_KNOWN_PATH: Fixed(
                    json_format.MessageToJson(card, indent=2).encode(), "application/json"
                ),
                "/metrics": Live(lambda: generate_latest(registry), CONTENT_TYPE_LATEST),
            }
            self._http = HttpServer(
                routes,
                self._host,
                self._http_port,
                tls=certificates.http_context() if certificates is not None else None,
                trusted_proxies=self.service.config.http_trusted_proxies,
            )
            try:
                await self._http.start()
            except OSError as exc:
                await server.stop(grace=None)
                self._grpc = None
                raise OSError(f"cannot serve HTTP on {host}:{self._http_port}: {exc}") from exc
            self.http_port = self._http.port
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        scheme = "https" if certificates is not None else "http"
        http = "off"
        if self.http_port is not None:
            http = f"{scheme}://{host}:{self.http_port}{WELL_KNOWN_PATH}"
        security = "plaintext"
        if certificates is not None:
            security = "mTLS" if certificates.files.client_ca is not None else "TLS"
        mode = "in-memory (one instance)"
        if self.service.cluster is not None and self._nats is not None:
            from ..jetstream.natsconfig import without_userinfo

            nats = ", ".join(without_userinfo(url) for url in self._nats.servers)
            mode = f"cluster mode: NATS {nats}, instance {self.service.cluster.instance_id}"
        logger.info(
            "a2a-grpc-server ready: grpc %s (%s), agent card %s, %s",
            self.grpc_address,
            security,
            http,
            mode,
        )

    async def drain(self) -> None:
        """Say NOT_SERVING at once, and go on serving for ``shutdown_drain`` seconds.

        What ``serve`` does on SIGTERM before ``stop``: load balancers and a
        Kubernetes Service take the instance out of rotation while it still
        accepts, so no client meets a refused connection.
        """
        await self._health.enter_graceful_shutdown()
        drain = self.service.config.shutdown_drain
        if drain > 0:
            logger.info("draining: NOT_SERVING, accepting for %.1f s more", drain)
            await asyncio.sleep(drain)  # sync-ok: the drain is a delay by definition

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, let tasks finish for ``grace`` s, end the rest FAILED, close.

        Every open stream gets its final frame before the gRPC server closes,
        and every A2A call still being served gets ``shutdown_flush`` seconds
        to answer before the server closes (a call refused meanwhile is
        UNAVAILABLE, retryable).
        """
        await self._health.enter_graceful_shutdown()
        await self.service.shutdown(grace)
        if self._http is not None:
            await self._http.stop()
        if self._grpc is not None:
            await self._close_grpc(self._grpc)
            self._grpc = None
        if self.service.cluster is not None:
            await self.service.cluster.close()

    async def _close_grpc(self, server: grpc.aio.Server) -> None:
        """Close the gRPC server without cutting a call CANCELLED (see ``rpc.closing``).

        New calls are held from now on; the calls being served get
        ``shutdown_flush`` seconds to answer (streams have their final frames
        already); once they have (and a moment more, for calls on their way to
        be taken), the server stops: its GOAWAY goes out while every new call is
        held, and ``GOAWAY_SETTLE`` later the held calls are refused
        UNAVAILABLE, to be retried on a new connection.
        """
        closing, flush = self.service.closing, self.service.config.shutdown_flush
        loop = asyncio.get_running_loop()
        until = loop.time() + flush
        closing.begin(hold_most=flush + TAKE_SETTLE + GOAWAY_SETTLE * 2)  # (released before)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(flush):
                await self.service.rpc_metrics.wait_quiet()
                await asyncio.sleep(TAKE_SETTLE)  # sync-ok: calls on their way are taken
        grace = max(GOAWAY_SETTLE * 2, until - loop.time())
        stopping = asyncio.ensure_future(server.stop(grace=grace))
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(GOAWAY_SETTLE):
                    await asyncio.shield(stopping)  # (it ends early only if nothing is held)
        finally:
            closing.release()
        await stopping

    async def __aenter__(self) -> A2AServer:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
