"""A container health probe: ``python -m a2a_grpc_server.healthcheck``, exit 0 when serving.

Asks this machine's server for the ``grpc.health.v1`` status of the A2A
service, within ``--timeout`` seconds; exits 0 for SERVING, 1 otherwise
(NOT_SERVING while it drains, or no answer). It reads the settings ``serve``
reads, from the same places (its flags, ``A2A_GRPC_SERVER_*`` variables, the
``--config`` file): the host (a wildcard bind is probed on 127.0.0.1), the
port, and TLS. With ``tls_cert`` it speaks TLS, trusting ``--ca`` if given,
else the system's CAs, then the server's own certificate itself (pinned: the
probe runs beside the server and reads the same file), checking the name the
certificate was issued to; with ``tls_client_ca`` (mTLS) it shows the
server's own certificate as its client certificate, which the server accepts
when one CA signed both. Flags given to ``serve`` itself cannot be seen from
here: give the probe the same ones, or set them as variables.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..model.names import A2A_SERVICE
from . import settings
from .service import WILDCARDS

SERVICE = A2A_SERVICE
NAMES = ("host", "port", "tls_cert", "tls_key", "tls_client_ca")
"""The settings of ``serve`` the probe reads."""


def check(
    address: str,
    service: str = SERVICE,
    timeout: float = 3.0,
    credentials: grpc.ChannelCredentials | None = None,
    options: list[tuple[str, Any]] | None = None,
) -> bool:
    """Whether the server at ``address`` says ``service`` is SERVING."""
    try:
        if credentials is None:
            channel = grpc.insecure_channel(address, options=options)  # type: ignore[no-untyped-call]
        else:
            channel = grpc.secure_channel(address, credentials, options=options)  # type: ignore[no-untyped-call]
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def tls(
    cert: Path, key: Path | None, mutual: bool, ca: Path | None
) -> list[tuple[grpc.ChannelCredentials, list[tuple[str, Any]]]]:
    """Ways to trust the server's certificate, each with the name to check it by.

    With ``ca``, that trust anchor alone; else the system's (a certificate from
    a public CA), then the server's own chain (a self-signed certificate).

    Raises:
        OSError: A file cannot be read.
    """
    chain = cert.read_bytes()
    own = (key.read_bytes(), chain) if mutual and key is not None else (None, None)
    name = _issued_to(cert)
    options: list[tuple[str, Any]] = [("grpc.ssl_target_name_override", name)] if name else []
    anchors = [ca.read_bytes()] if ca is not None else [None, chain]
    return [
        (grpc.ssl_channel_credentials(roots, *own), options)  # type: ignore[no-untyped-call]
        for roots in anchors
    ]


def _issued_to(cert: Path) -> str:
    """A name the certificate was issued to (its first DNS name, else its common name)."""
    try:
        decoded = ssl._ssl._test_decode_cert(str(cert))  # type: ignore[attr-defined]
    except (ssl.SSLError, OSError):
        return ""
    for kind, value in decoded.get("subjectAltName", ()):
        if kind in ("DNS", "IP Address"):
            return str(value)
    for part in decoded.get("subject", ()):
        for field, value in part:
            if field == "commonName":
                return str(value)
    return ""


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 serving, 1 not (2: the settings, or a file they name, could not be read)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="HOST:PORT to probe (default: from the settings)")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--tls-cert", type=Path)
    parser.add_argument("--tls-key", type=Path)
    parser.add_argument("--tls-client-ca", type=Path)
    parser.add_argument("--ca", type=Path, help="trust anchor for the server's certificate")
    parser.add_argument("--config", type=Path, help=f"the TOML file (env {settings.CONFIG_ENV})")
    parser.add_argument("--service", default=SERVICE, help='"" for the whole server')
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        found = _settings(args)
    except ValueError as exc:
        print(f"a2a-grpc-server healthcheck: {exc}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if found["host"] in WILDCARDS else str(found["host"])
    address = args.address or f"{f'[{host}]' if ':' in host else host}:{found['port']}"
    if found["tls_cert"]:
        key = Path(found["tls_key"]) if found["tls_key"] else None
        try:
            ways = tls(Path(found["tls_cert"]), key, bool(found["tls_client_ca"]), args.ca)
        except OSError as exc:  # (a setting names a file it cannot read: as a bad setting)
            print(f"a2a-grpc-server healthcheck: {exc}", file=sys.stderr)
            return 2
        each = args.timeout / len(ways)
        serving = any(check(address, args.service, each, c, o) for c, o in ways)
    else:
        serving = check(address, args.service, args.timeout)
    print("SERVING" if serving else "NOT SERVING", file=sys.stderr)
    return 0 if serving else 1


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """host, port, tls_cert, tls_key, tls_client_ca as ``serve`` would take them."""
    given = {name: value for name in NAMES if (value := getattr(args, name)) is not None}
    given = {k: str(v) if isinstance(v, Path) else v for k, v in given.items()}
    path = args.config or os.environ.get(settings.CONFIG_ENV)
    values = settings.resolve(given, os.environ, Path(path) if path else None)
    return {
        name: values[name][0] for name in ("host", "port", "tls_cert", "tls_key", "tls_client_ca")
    }


if __name__ == "__main__":
    sys.exit(main())
