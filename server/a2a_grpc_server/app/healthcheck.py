"""A container health probe: ``python -m a2a_grpc_server.healthcheck``, exit 0 when serving.

Asks this machine's server (``127.0.0.1`` and ``A2A_GRPC_SERVER_PORT``, or
``--address``) for ``grpc.health.v1`` status of the A2A service, within
``--timeout`` seconds; exits 0 for SERVING, 1 otherwise (NOT_SERVING while it
drains, or no answer). Plaintext only: with ``--tls-cert``, probe through what
terminates TLS, or use ``grpc_health_probe -tls``.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "lf.a2a.v1.A2AService"


def check(address: str, service: str = SERVICE, timeout: float = 3.0) -> bool:
    """Whether the server at ``address`` says ``service`` is SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:  # type: ignore[no-untyped-call]
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 serving, 1 not."""
    port = os.environ.get("A2A_GRPC_SERVER_PORT", "50051")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=f"127.0.0.1:{port}")
    parser.add_argument("--service", default=SERVICE, help='"" for the whole server')
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    serving = check(args.address, args.service, args.timeout)
    print("SERVING" if serving else "NOT SERVING", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
