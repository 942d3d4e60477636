"""Shared fixtures: every test runs against a real server; see ``harness``."""

from __future__ import annotations

import logging

import pytest

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
