"""Cluster mode refuses a nats-server older than it works with, saying which and what to do:
when it connects, and when a replica of one answers a batched read.

The version is what the server said when the client connected (nats-py's
``ServerVersion``); no older binary is available here, so the check is asserted on
the versions a server may say, and once against the real one.
"""

from __future__ import annotations

import pytest
from nats.aio.client import ServerVersion
from nats.aio.msg import Msg

from a2a_grpc_server._internal.jetstream.conn import NatsConfig, connect, server_too_old
from a2a_grpc_server._internal.jetstream.requests import batches, ended
from a2a_grpc_server._internal.journal import StoreRefusedError


@pytest.mark.parametrize("said", ["2.11.0", "2.12.0-RC.1", "2.15.1", "3.0.0"])
def test_a_server_new_enough_is_taken(said: str) -> None:
    assert server_too_old(ServerVersion(said)) is None


@pytest.mark.parametrize(("said", "shown"), [("2.10.22", "2.10"), ("1.4.1", "1.4")])
def test_an_older_server_is_refused_saying_which_and_what_to_do(said: str, shown: str) -> None:
    why = server_too_old(ServerVersion(said))
    assert why is not None
    assert f"nats-server {shown} is older than 2.11" in why
    assert "upgrade the NATS servers" in why


@pytest.mark.parametrize("said", ["two-point-eleven", "0.0.0-unknown", "v2.11.0"])
def test_a_version_that_does_not_parse_is_refused_as_such(said: str) -> None:
    # ("0.0.0-unknown": what nats-py makes of a server that said no version)
    why = server_too_old(ServerVersion(said))
    assert why == f"nats-server says its version is {said!r}, which cluster mode cannot read"


async def test_the_server_the_tests_run_is_taken(nats_url: str) -> None:
    conn = await connect(NatsConfig(servers=[nats_url]))
    try:
        assert server_too_old(conn.nc.connected_server_version) is None
        assert conn.nc.connected_server_version.minor >= 11
    finally:
        await conn.close()


def _answer(seq: int, pending: str | None) -> Msg:
    headers = {"Nats-Sequence": str(seq), **({"Nats-Num-Pending": pending} if pending else {})}
    return Msg(_client=None, subject="a2a.log.x", headers=headers)  # type: ignore[arg-type]


async def test_a_batched_answer_that_says_nothing_pending_is_refused_not_taken_for_the_end() -> (
    None
):
    # A replica older than 2.11, in a cluster being upgraded, ignores ``batch`` and
    # answers one message without Nats-Num-Pending: read on as the end, a task's changes
    # or a listing's entries would be cut short without a word.
    asked: list[dict[str, object]] = []

    async def old_replica(request: dict[str, object]) -> list[Msg]:
        asked.append(request)
        return [_answer(int(str(request["seq"])), None)]

    with pytest.raises(StoreRefusedError, match=r"older than 2\.11"):
        [msgs async for msgs in batches(old_replica, "a2a.log.x", 7, 100, 256)]
    assert len(asked) == 1
    assert ended([]) is True
    assert ended([_answer(3, "0")]) is True
    assert ended([_answer(3, "2")]) is False
