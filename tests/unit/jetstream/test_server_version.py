"""Cluster mode refuses a nats-server older than it works with, saying which and what to do.

The version is what the server said when the client connected (nats-py's
``ServerVersion``); no older binary is available here, so the check is asserted on
the versions a server may say, and once against the real one.
"""

from __future__ import annotations

import pytest
from nats.aio.client import ServerVersion

from a2a_grpc_server.jetstream.conn import NatsConfig, connect, server_too_old


@pytest.mark.parametrize("said", ["2.11.0", "2.12.0-RC.1", "2.15.1", "3.0.0"])
def test_a_server_new_enough_is_taken(said: str) -> None:
    assert server_too_old(ServerVersion(said)) is None


@pytest.mark.parametrize(("said", "shown"), [("2.10.22", "2.10"), ("1.4.1", "1.4")])
def test_an_older_server_is_refused_saying_which_and_what_to_do(said: str, shown: str) -> None:
    why = server_too_old(ServerVersion(said))
    assert why is not None
    assert f"nats-server {shown} is older than 2.11" in why
    assert "upgrade the NATS servers" in why


def test_a_version_that_does_not_parse_is_refused_as_such() -> None:
    why = server_too_old(ServerVersion("two-point-eleven"))
    assert (
        why == "nats-server says its version is 'two-point-eleven', which cluster mode cannot read"
    )


async def test_the_server_the_tests_run_is_taken(nats_url: str) -> None:
    conn = await connect(NatsConfig(servers=[nats_url]))
    try:
        assert server_too_old(conn.nc.connected_server_version) is None
        assert conn.nc.connected_server_version.minor >= 11
    finally:
        await conn.close()
