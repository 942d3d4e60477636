"""Agent references in every shape ``serve --agent`` accepts (used by test_cli)."""

from __future__ import annotations

from a2a_grpc_server.agents.echo import EchoAgent

instance = EchoAgent()


def factory() -> EchoAgent:
    """A zero-argument factory."""
    return EchoAgent()


not_an_agent = 42
