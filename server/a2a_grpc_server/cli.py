"""``a2a-grpc-server serve``: run an agent as a standalone A2A gRPC server.

Signals: the first SIGTERM/SIGINT drains (stop accepting, grace period, end
the remaining tasks FAILED with a final frame), then exits 0; a second one cuts
the grace period short (every task ends FAILED with its final frame at once),
then exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import inspect
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from a2a.server.agent_execution import AgentExecutor
from a2a.types.a2a_pb2 import AgentCard
from google.protobuf import json_format

from . import logs
from .app import A2AServer
from .auth import Authenticator, ClientCertificate, TokenFile, TrustedHeader
from .config import ServerConfig
from .jwtauth import JwtAuthenticator
from .settings import add_flags, chosen
from .tls import TlsFiles

if TYPE_CHECKING:
    from .jetstream.conn import NatsConfig

logger = logging.getLogger("a2a_grpc_server")

DEFAULT_AGENT = "a2a_grpc_server.agents.echo:EchoAgent"
EXIT_FORCED = 3
"""Exit status after a second signal cut the drain short (2 is a usage error)."""
_DEFAULTS = ServerConfig()


class AgentLoadError(Exception):
    """The ``--agent`` reference does not name a usable executor."""


def load_agent(ref: str) -> tuple[AgentExecutor, AgentCard | None]:
    """Resolve ``module:attr`` to an executor and the module's card, if it has one.

    ``attr`` may be an ``AgentExecutor`` instance, a subclass, or a
    zero-argument factory. The module may define ``agent_card`` (an
    ``AgentCard`` or a zero-argument function returning one). Modules are
    imported from the current directory as well as installed packages.

    Raises:
        AgentLoadError: The reference is malformed or names something else.
    """
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"--agent {ref!r}: expected module:attr, e.g. my_agent:MyExecutor")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentLoadError(f"--agent {ref!r}: cannot import {module_name!r}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise AgentLoadError(f"--agent {ref!r}: module {module_name!r} has no {attr!r}")
    executor = (
        target()
        if inspect.isclass(target) or (not isinstance(target, AgentExecutor) and callable(target))
        else target
    )
    if not isinstance(executor, AgentExecutor):
        raise AgentLoadError(
            f"--agent {ref!r}: {attr!r} is not an AgentExecutor, a subclass, or a factory of one"
        )
    card = getattr(module, "agent_card", None)
    if callable(card):
        card = card()
    return executor, card if isinstance(card, AgentCard) else None


def _authenticator(args: argparse.Namespace) -> Authenticator | None:
    """The authenticator the flags ask for (None: every caller is anonymous).

    Raises:
        SystemExit: The tokens file is missing or malformed (the message says where).
    """
    chosen = [
        bool(args.auth_tokens),
        args.auth_mtls,
        bool(args.auth_trusted_header),
        bool(args.auth_jwt_jwks),
    ]
    if sum(chosen) > 1:
        raise SystemExit(
            "choose one of --auth-tokens, --auth-mtls, --auth-trusted-header, --auth-jwt-jwks"
        )
    if args.auth_jwt_jwks:
        if not (args.auth_jwt_issuer and args.auth_jwt_audience):
            raise SystemExit("--auth-jwt-jwks needs --auth-jwt-issuer and --auth-jwt-audience")
        try:
            return JwtAuthenticator(
                args.auth_jwt_jwks,
                args.auth_jwt_issuer,
                args.auth_jwt_audience,
                args.auth_jwt_claim,
            )
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.auth_mtls:
        if not args.tls_client_ca:
            raise SystemExit("--auth-mtls needs --tls-client-ca (and --tls-cert, --tls-key)")
        return ClientCertificate()
    if args.auth_trusted_header:
        return TrustedHeader(args.auth_trusted_header)
    if not args.auth_tokens:
        return None
    try:
        return TokenFile(Path(args.auth_tokens))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _extended_card(args: argparse.Namespace) -> AgentCard | None:
    """The card ``--extended-card`` names (None: no extended card).

    Raises:
        SystemExit: The flag comes without authentication, or the file is not a card.
    """
    if not args.extended_card:
        return None
    if not (args.auth_tokens or args.auth_mtls or args.auth_trusted_header or args.auth_jwt_jwks):
        raise SystemExit(
            "--extended-card is for authenticated callers: add one of --auth-tokens, "
            "--auth-mtls, --auth-trusted-header, --auth-jwt-jwks"
        )
    path = Path(args.extended_card)
    try:
        return json_format.Parse(path.read_text(), AgentCard(), ignore_unknown_fields=False)
    except (OSError, json_format.ParseError) as exc:
        raise SystemExit(
            f"--extended-card {path}: not a readable AgentCard (JSON): {exc}"
        ) from None


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name, checked (None: plaintext).

    Raises:
        SystemExit: A flag is missing or a file unusable (the message says which).
    """
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    files = TlsFiles(
        Path(args.tls_cert),
        Path(args.tls_key),
        Path(args.tls_client_ca) if args.tls_client_ca else None,
    )
    try:
        files.check()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return files


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(prog="a2a-grpc-server", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve an agent over gRPC")
    serve.add_argument("--agent", default=DEFAULT_AGENT, help="module:attr of the AgentExecutor")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051)")
    serve.add_argument(
        "--http-port", type=int, default=8080, help="agent card HTTP port (default 8080)"
    )
    serve.add_argument("--cancel-timeout", type=float, default=_DEFAULTS.cancel_timeout)
    serve.add_argument("--shutdown-grace", type=float, default=_DEFAULTS.shutdown_grace)
    serve.add_argument("--max-final-tasks", type=int, default=_DEFAULTS.max_final_tasks)
    serve.add_argument("--final-task-ttl", type=float, default=_DEFAULTS.final_task_ttl)
    serve.add_argument(
        "--auth-tokens",
        metavar="FILE",
        help="require bearer tokens: one 'principal:token' per line (# comments); re-read "
        "when it changes",
    )
    serve.add_argument(
        "--auth-mtls",
        action="store_true",
        help="the caller is its client certificate's SPIFFE ID or common name (needs "
        "--tls-client-ca)",
    )
    serve.add_argument(
        "--auth-trusted-header",
        metavar="NAME",
        help="the caller is this header's value, set by a proxy that authenticated it; "
        "only behind that proxy",
    )
    serve.add_argument(
        "--auth-jwt-jwks",
        metavar="FILE_OR_URL",
        help="require JWT bearer tokens signed by a key of this JWKS (with --auth-jwt-issuer "
        "and --auth-jwt-audience)",
    )
    serve.add_argument("--auth-jwt-issuer", metavar="ISS", help="the 'iss' JWTs must carry")
    serve.add_argument("--auth-jwt-audience", metavar="AUD", help="the 'aud' JWTs must carry")
    serve.add_argument(
        "--auth-jwt-claim", metavar="CLAIM", default="sub", help="the claim naming the caller"
    )
    serve.add_argument(
        "--extended-card",
        metavar="FILE",
        help="give authenticated callers this card (JSON AgentCard) from GetExtendedAgentCard",
    )
    add_flags(serve.add_argument_group("quotas per principal (0: none)"), "quota_")
    add_flags(serve.add_argument_group("gRPC transport"), "grpc_")
    tls = serve.add_argument_group("transport security (both ports)")
    tls.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    tls.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    tls.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        help="require client certificates signed by these CAs (mTLS)",
    )
    push = serve.add_argument_group("push notifications (webhooks)")
    push.add_argument(
        "--no-push",
        action="store_true",
        help="serve no push notifications (the push RPCs answer PushNotificationNotSupported)",
    )
    push.add_argument(
        "--push-allow-private",
        action="store_true",
        help="allow http and private, loopback and link-local webhook addresses (tests, "
        "webhooks inside the same network); by default only https to public addresses",
    )
    push.add_argument(
        "--push-allow-hosts",
        metavar="HOST[,HOST...]",
        default="",
        help="webhook hosts trusted whatever they resolve to (*.example.com for subdomains)",
    )
    push.add_argument(
        "--push-ca-file",
        metavar="PEM",
        default="",
        help="verify webhook certificates against these CAs (default: the public CAs)",
    )
    cluster = serve.add_argument_group("cluster mode (NATS JetStream; pip install '.[cluster]')")
    cluster.add_argument(
        "--nats",
        metavar="URL[,URL...]",
        help="join the cluster on these NATS servers, e.g. nats://127.0.0.1:4222 "
        "(default: no cluster, in-memory journal)",
    )
    cluster.add_argument(
        "--nats-replicas", type=int, default=1, help="JetStream replicas (3 on a 3-node cluster)"
    )
    cluster.add_argument(
        "--lease",
        type=float,
        default=10.0,
        help="seconds without a heartbeat before an instance's tasks end FAILED; keep it "
        "above NATS failover time (default 10)",
    )
    cluster.add_argument("--instance-id", help="this instance's id (default: a new one per start)")
    serve.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="event loop; auto: uvloop if installed (pip install '.[perf]'), else asyncio",
    )
    serve.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=logs.FORMATS,
        help="text, or json: one object per line with time, level, message, and task id, "
        "context id, principal, instance and trace id when known",
    )
    return parser


async def serve(args: argparse.Namespace) -> None:
    """Run the server until a signal asks it to stop."""
    executor, card = load_agent(args.agent)
    config = ServerConfig(
        cancel_timeout=args.cancel_timeout,
        shutdown_grace=args.shutdown_grace,
        max_final_tasks=args.max_final_tasks,
        final_task_ttl=args.final_task_ttl,
        push=not args.no_push,
        push_allow_private=args.push_allow_private,
        push_allow_hosts=tuple(h.strip() for h in args.push_allow_hosts.split(",") if h.strip()),
        push_ca_file=args.push_ca_file,
        **chosen(args, "quota_"),
        **chosen(args, "grpc_"),
    )
    server = A2AServer(
        executor,
        card,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        config=config,
        nats=_nats_config(args),
        tls=_tls_files(args),
        auth=_authenticator(args),
        extended_card=_extended_card(args),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    main = asyncio.current_task()
    assert main is not None

    def on_signal() -> None:
        if stop.is_set():
            logger.warning("second signal: ending every task now")
            main.cancel()  # cuts the drain's grace short (below)
            return
        logger.info("signal received: draining (send it again to end every task at once)")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await server.start()
    if server.service.cluster is not None:
        logs.set_instance(server.service.cluster.instance_id)
    # Everything loaded so far (grpc, protobuf, the agent) lives as long as
    # the process: keep it out of the collector's full passes, which would
    # otherwise pause the loop for tens of milliseconds now and then.
    gc.collect()
    gc.freeze()
    try:
        await stop.wait()
        await server.stop()
    except asyncio.CancelledError:
        # A second signal: every task ends FAILED now, streams get their final
        # frame; then SystemExit, so asyncio.run still runs every ``finally``.
        await server.stop(grace=0)
        raise SystemExit(EXIT_FORCED) from None
    logger.info("stopped")


def _run(main: Coroutine[Any, Any, None], loop: str) -> None:
    """Run ``main`` on the chosen event loop (see ``--loop``)."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                main.close()
                raise ValueError(
                    "--loop uvloop: uvloop is not installed (pip install '.[perf]')"
                ) from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def _nats_config(args: argparse.Namespace) -> NatsConfig | None:
    if not args.nats:
        return None
    try:
        from .jetstream.conn import NatsConfig as Config
    except ImportError as exc:
        raise ValueError(
            f"--nats needs the cluster extra (pip install '.[cluster]'): {exc}"
        ) from exc
    if args.lease <= 0 or args.nats_replicas < 1:
        raise ValueError("--lease must be > 0 and --nats-replicas >= 1")
    servers = [url.strip() for url in args.nats.split(",") if url.strip()]
    extra = {"instance_id": args.instance_id} if args.instance_id else {}
    return Config(servers=servers, replicas=args.nats_replicas, lease=args.lease, **extra)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``a2a-grpc-server`` command."""
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format, socket.gethostname())
    try:
        _run(serve(args), args.loop)
    except (AgentLoadError, ValueError) as exc:
        print(f"a2a-grpc-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"a2a-grpc-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
