"""Echo agent: the server's default agent, shown here as a runnable example.

Its source is ``server/a2a_grpc_server/agents/echo.py`` (installed with the
package so ``a2a-grpc-server serve`` works with no arguments).

Run it: ``a2a-grpc-server serve --agent examples.echo_agent:EchoAgent``
"""

from __future__ import annotations

from a2a_grpc_server.agents.echo import EchoAgent, agent_card

__all__ = ["EchoAgent", "agent_card"]
