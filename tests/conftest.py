"""Shared fixtures: every test runs against a real server; see ``harness``."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.support import natsserver

logging.getLogger("a2a_grpc_server").setLevel(logging.DEBUG)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the fault and abuse suite at full length (more fuzz examples, a longer soak)",
    )


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> bool:
    """Whether ``--long`` was given: suites scale their examples and durations by it."""
    return bool(request.config.getoption("--long"))


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A single-node nats-server with JetStream, shared by the tests of one module."""
    with natsserver.running(1) as cluster:
        yield cluster.urls[0]
