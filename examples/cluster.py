"""Two instances sharing their tasks on one machine: a local nats-server and two ``serve``.

    python -m examples.cluster [BASE_PORT]

Starts ``nats-server -js`` on a free loopback port (the ``cluster`` extra
ships the binary), writes a fresh cluster key (the secret both instances
sign their routed requests with) to a temporary file, then two
``a2a-grpc-server serve --nats ... --nats-key-file ...`` processes
on BASE_PORT and BASE_PORT+1 (default 50051; agent cards on BASE_PORT+1000
and +1001; BASE_PORT 0: free ports for all). Any instance serves any task:
send a message to one, read or cancel it through the other. Ctrl-C stops
the instances (each drains), then NATS.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading

from a2a_grpc_server.testing import nats_server

READY = re.compile(r"ready: grpc (\S+)")


def start_instance(
    nats_url: str, key_file: str, port: int, http_port: int
) -> tuple[subprocess.Popen[str], str]:
    """Start one ``serve`` joined to NATS; return it once it printed its ready line."""
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "a2a_grpc_server.cli", "serve",
            "--port", str(port), "--http-port", str(http_port), "--nats", nats_url,
            "--nats-key-file", key_file,
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Ctrl-C reaches this script only; it stops them in order
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:
        if match := READY.search(line):
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError(f"instance on port {port} exited ({proc.wait()})")


def _drain(proc: subprocess.Popen[str]) -> None:
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)


def main(base_port: int) -> None:
    """Run until Ctrl-C (or SIGTERM)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with nats_server() as nats, tempfile.TemporaryDirectory(prefix="a2a-example-") as tmp:
        url = nats.urls[0]
        key_file = os.path.join(tmp, "cluster.key")
        with open(os.open(key_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as key:
            key.write(secrets.token_hex(32))  # (openssl rand -hex 32, in a real deploy)
        instances = []
        try:
            for i in range(2):
                ports = (base_port + i, base_port + 1000 + i) if base_port else (0, 0)
                proc, address = start_instance(url, key_file, *ports)
                instances.append(proc)
                print(f"instance {i}: grpc {address}", flush=True)
            print(f"nats: {url}; Ctrl-C to stop", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                stop.wait()
        finally:
            for proc in instances:
                proc.send_signal(signal.SIGTERM)
            for proc in instances:
                proc.wait(timeout=30)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50051)
