"""``a2a-grpc-server serve``: run an agent as a standalone A2A gRPC server.

Signals: the first SIGTERM/SIGINT drains — health NOT_SERVING at once, still
accepting for ``shutdown_drain`` seconds, then stop accepting, the grace period
for running tasks, waiting tasks left to the cluster (cluster mode), the
remaining tasks ended FAILED with a final frame — then exits 0; a second one
cuts the drain and the grace period short (every task ends at once, with its
final frame), then exits 3.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import inspect
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

from a2a.server.agent_execution import AgentExecutor
from a2a.types.a2a_pb2 import AgentCard
from google.protobuf import json_format

from ..jetstream.formats import READS, version
from ..obs import logs
from ..rpc.auth import Authenticator, ClientCertificate, TokenFile, TrustedHeader
from ..rpc.jwtauth import JwtAuthenticator
from . import settings
from .preflight import check_advertised, check_port_free, warn_if_loopback_advertised
from .service import A2AServer
from .settings import SettingError, spelled
from .tls import TlsFiles

logger = logging.getLogger("a2a_grpc_server")

EXIT_FORCED = 3
"""Exit status after a second signal cut the drain short (2 is a usage error)."""
DESCRIPTION = "Run an agent as a standalone A2A gRPC server."
"""What ``--help`` says first (plain text: argparse shows it as it is)."""


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
    where = spelled("agent", repr(ref))
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise AgentLoadError(f"{where}: expected module:attr, e.g. my_agent:MyExecutor")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentLoadError(f"{where}: cannot import {module_name!r}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise AgentLoadError(f"{where}: module {module_name!r} has no {attr!r}")
    executor = (
        target()
        if inspect.isclass(target) or (not isinstance(target, AgentExecutor) and callable(target))
        else target
    )
    if not isinstance(executor, AgentExecutor):
        raise AgentLoadError(
            f"{where}: {attr!r} is not an AgentExecutor, a subclass, or a factory of one"
        )
    card = getattr(module, "agent_card", None)
    if card is None:
        logger.warning(
            "%s: module %r defines no agent_card, so clients get a generic card "
            "(name 'A2A agent', one generic skill); define agent_card in it (an AgentCard, "
            "or a function returning one) to describe the agent",
            where,
            module_name,
        )
        return executor, None
    if callable(card):
        card = card()
    if not isinstance(card, AgentCard):
        raise AgentLoadError(
            f"{where}: {module_name}.agent_card is a {type(card).__name__}, not an "
            "AgentCard (a2a.types.a2a_pb2.AgentCard) or a function returning one"
        )
    return executor, card


def _authenticator(args: argparse.Namespace) -> Authenticator | None:
    """The authenticator the flags ask for (None: every caller is anonymous).

    Raises:
        SettingError: The tokens file is missing or malformed (the message says where).
    """
    chosen = [
        bool(args.auth_tokens),
        args.auth_mtls,
        bool(args.auth_trusted_header),
        bool(args.auth_jwt_jwks),
    ]
    if sum(chosen) > 1:
        raise SettingError(f"choose one of {_any_of(AUTH_SETTINGS)}")
    if args.auth_jwt_jwks:
        if not (args.auth_jwt_issuer and args.auth_jwt_audience):
            raise SettingError(
                f"{spelled('auth_jwt_jwks')} needs {spelled('auth_jwt_issuer')} and "
                f"{spelled('auth_jwt_audience')}"
            )
        try:
            return JwtAuthenticator(
                args.auth_jwt_jwks,
                args.auth_jwt_issuer,
                args.auth_jwt_audience,
                args.auth_jwt_claim,
                allow_http_loopback=args.auth_jwt_allow_http_loopback,
            )
        except ValueError as exc:
            raise SettingError(f"{spelled('auth_jwt_jwks')}: {exc}") from None
    if args.auth_mtls:
        if not args.tls_client_ca:
            raise SettingError(
                f"{spelled('auth_mtls')} needs {spelled('tls_client_ca')} (and "
                f"{spelled('tls_cert')}, {spelled('tls_key')})"
            )
        return ClientCertificate()
    if args.auth_trusted_header:
        return TrustedHeader(args.auth_trusted_header)
    if not args.auth_tokens:
        return None
    try:
        return TokenFile(Path(args.auth_tokens))
    except ValueError as exc:
        raise SettingError(f"{spelled('auth_tokens')}: {exc}") from None


AUTH_SETTINGS = ("auth_tokens", "auth_mtls", "auth_trusted_header", "auth_jwt_jwks")
"""The authentication settings, of which one at most is given."""


def _any_of(names: Sequence[str]) -> str:
    """``names`` spelled (see ``settings.spelled``), as a list to choose from."""
    return ", ".join(spelled(name) for name in names[:-1]) + f" or {spelled(names[-1])}"


def _extended_card(args: argparse.Namespace) -> AgentCard | None:
    """The card ``--extended-card`` names (None: no extended card).

    Raises:
        SettingError: The flag comes without authentication, or the file is not a card.
    """
    if not args.extended_card:
        return None
    if not (args.auth_tokens or args.auth_mtls or args.auth_trusted_header or args.auth_jwt_jwks):
        raise SettingError(
            f"{spelled('extended_card')} is for authenticated callers: add {_any_of(AUTH_SETTINGS)}"
        )
    path = Path(args.extended_card)
    try:
        return json_format.Parse(path.read_text(), AgentCard(), ignore_unknown_fields=False)
    except (OSError, json_format.ParseError) as exc:
        raise SettingError(
            f"{spelled('extended_card', path)}: not a readable AgentCard (JSON): {exc}"
        ) from None


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the flags name, checked (None: plaintext).

    Raises:
        SettingError: A flag is missing or a file unusable (the message says which).
    """
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise SettingError(
            f"{spelled('tls_cert')} and {spelled('tls_key')} go together (and "
            f"{spelled('tls_client_ca')} needs both)"
        )
    named = {"tls_cert": args.tls_cert, "tls_key": args.tls_key}
    if args.tls_client_ca:
        named["tls_client_ca"] = args.tls_client_ca
    for name, path in named.items():
        if not Path(path).is_file():
            raise SettingError(f"{spelled(name, path)}: the file does not exist")
    files = TlsFiles(
        Path(args.tls_cert),
        Path(args.tls_key),
        Path(args.tls_client_ca) if args.tls_client_ca else None,
    )
    try:
        files.check()
    except ValueError as exc:
        raise SettingError(f"{' and '.join(spelled(name) for name in named)}: {exc}") from None
    return files


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``serve`` and ``check-config``, with every setting's flag."""
    parser = argparse.ArgumentParser(prog="a2a-grpc-server", description=DESCRIPTION)
    parser.add_argument(
        "--version",
        action="version",
        version=f"a2a-grpc-server {version()} (formats read: {sorted(READS)})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("serve", "serve an agent over gRPC"),
        ("check-config", "print the effective configuration (TOML), or say which value is wrong"),
    ):
        command = sub.add_parser(
            name,
            help=text,
            description=f"{text}. Every setting comes from its flag, else its environment "
            f"variable, else the --config file, else its default.",
        )
        command.add_argument(
            "--config",
            metavar="FILE",
            help=f"a TOML file of settings (keys: the settings' names; env {settings.CONFIG_ENV})",
        )
        settings.add_flags(command)
    return parser


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Every setting's value and source (see ``settings.resolve``).

    Raises:
        SettingError: A value that cannot be used.
    """
    given = {k: v for k, v in vars(args).items() if k in settings.BY_NAME}
    path = args.config or environ.get(settings.CONFIG_ENV)
    return settings.resolve(given, environ, Path(path) if path else None)


def prepare(values: dict[str, tuple[Any, str]]) -> A2AServer:
    """The server the settings describe, every check made (not started).

    Raises:
        SettingError: A setting, or a combination, that cannot be served (saying which).
        AgentLoadError: ``agent`` does not name a usable executor.
    """
    args = argparse.Namespace(**{name: value for name, (value, _) in values.items()})
    for warning in settings.retired(values):
        logger.warning("%s", warning)
    if args.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        raise SettingError(NO_UVLOOP)
    if args.admin and importlib.util.find_spec("grpc_channelz") is None:
        raise SettingError(
            f"{spelled('admin')} needs the admin extra: pip install 'a2a-grpc-server[admin]'"
        )
    if args.nats and importlib.util.find_spec("nats") is None:
        raise SettingError(
            f"{spelled('nats')} needs the cluster extra (nats-py): "
            "pip install 'a2a-grpc-server[cluster]'"
        )
    if args.advertise is not None:
        check_advertised(args.advertise)
    else:
        warn_if_loopback_advertised(args.host)
    executor, card = load_agent(args.agent)
    return A2AServer(
        executor,
        card,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        config=settings.server_config(values),
        nats=settings.nats_config(values),
        tls=_tls_files(args),
        auth=_authenticator(args),
        extended_card=_extended_card(args),
        admin=args.admin,
        advertise=args.advertise,
    )


NO_UVLOOP = f"{spelled('loop', 'uvloop')}: uvloop is not installed (pip install uvloop)"


async def serve(server: A2AServer) -> None:
    """Run the server until a signal asks it to stop."""
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
        await server.drain()  # NOT_SERVING, still accepting for shutdown_drain seconds
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
                raise ValueError(NO_UVLOOP) from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``a2a-grpc-server`` command."""
    args = build_parser().parse_args(argv)
    try:
        values = resolve(args, os.environ)
        logs.configure(values["log_level"][0], values["log_format"][0], socket.gethostname())
        server = prepare(values)  # every check, for check-config too
        if args.command == "check-config":
            print(settings.render(values), end="")
            return 0
        host = values["host"][0]
        check_port_free(host, values["port"][0], "port", "gRPC")
        check_port_free(host, values["http_port"][0], "http_port", "HTTP")
        _run(serve(server), values["loop"][0])
    except (AgentLoadError, ValueError) as exc:
        print(f"a2a-grpc-server: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"a2a-grpc-server: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
