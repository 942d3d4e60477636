"""Cluster mode uses nats-py's public API only, so ``pyproject.toml`` may allow any 2.x
from the version tested (``nats-py>=2.16,<3``).

The lesson behind it: a library's private internals need a pinned range and a check at
start-up. ``jetstream`` has none left (the coalescing client, ``bucket_of`` and the
swapped ``_error_cb`` were the last), and this keeps it so: a private attribute reached
through anything but ``self`` or ``cls`` fails here, naming where. One behaviour beyond
the documented API is relied on, and tested here on a real nats-server: the client's
``options`` are read again at each reconnect.
"""

from __future__ import annotations

import ast
import asyncio
import logging

from a2a_grpc_server._internal.jetstream.conn import CONNECT_ATTEMPTS, NatsConfig, connect
from tests.support import ROOT
from tests.support.natsserver import running

PACKAGE = ROOT / "server" / "a2a_grpc_server" / "_internal" / "jetstream"


def private_reaches(source: str) -> list[tuple[int, str]]:
    """Each ``x._name`` in ``source`` whose ``x`` is not ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_a_private_reach() -> None:
    assert private_reaches("def f(kv):\n    return kv._js\n") == [(2, "kv._js")]
    assert private_reaches("class A:\n    def f(self):\n        return self._x\n") == []


def test_jetstream_reaches_into_nothing_private() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) > 20
    reaches = {
        f"{path.name}:{line}": text
        for path in files
        for line, text in private_reaches(path.read_text())
    }
    assert reaches == {}


class _Counting(logging.Handler):
    """Sets ``failed`` after ``enough`` failed reconnects are logged, ``back`` at the reconnect."""

    def __init__(self, enough: int) -> None:
        super().__init__()
        self.enough, self.failures = enough, 0
        self.failed, self.back = asyncio.Event(), asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("NATS: "):
            self.failures += 1
            if self.failures >= self.enough:
                self.failed.set()
        elif text == "reconnected to NATS":
            self.back.set()


async def test_an_outage_longer_than_the_first_connects_attempts_is_reconnected() -> None:
    # The one behaviour of nats-py relied on beyond its documented API: ``connect``
    # bounds the first connect to CONNECT_ATTEMPTS per URL, then sets the client's
    # ``options["max_reconnect_attempts"]`` to -1, which nats-py reads again at each
    # reconnect. A nats-py that copied its options at connect would give up here.
    counting = _Counting(enough=CONNECT_ATTEMPTS * 2 + 1)
    logger = logging.getLogger("a2a_grpc_server.jetstream.conn")
    logger.addHandler(counting)
    try:
        with running(1) as cluster:
            conn = await connect(NatsConfig(servers=cluster.urls))
            try:
                cluster.nodes[0].kill()
                async with asyncio.timeout(60):
                    await counting.failed.wait()  # (more failed attempts than the first had)
                    cluster.nodes[0].start()
                    await counting.back.wait()
                assert conn.nc.is_connected
                await conn.nc.flush(timeout=5)
            finally:
                await conn.close()
    finally:
        logger.removeHandler(counting)
