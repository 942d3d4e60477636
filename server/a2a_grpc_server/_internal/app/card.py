"""The agent card: defaults, and the gRPC endpoint filled in at start.

Clients (and the conformance kit) fetch ``/.well-known/agent-card.json``
(served by ``http``) to find the gRPC endpoint.
"""

from __future__ import annotations

from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentExtension,
    AgentInterface,
    AgentSkill,
    SecurityScheme,
)

WELL_KNOWN_PATH = "/.well-known/agent-card.json"
PROTOCOL_VERSION = "1.0"


def default_card(name: str = "A2A agent") -> AgentCard:
    """A card for an agent whose module gave none: streaming, one skill (push: the server's)."""
    return AgentCard(
        name=name,
        description="An A2A agent served over gRPC by a2a-grpc-server.",
        version="0.1.0",
        capabilities=AgentCapabilities(streaming=True),  # push: the server says (serve --push)
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            AgentSkill(
                id="default",
                name="Default",
                description="Whatever the agent does with a text message.",
                tags=["general"],
            )
        ],
    )


def with_grpc_endpoint(card: AgentCard, address: str) -> AgentCard:
    """Return a copy of ``card`` whose first interface is our gRPC endpoint.

    Args:
        card: The agent's card.
        address: ``host:port`` the gRPC server is bound to.
    """
    result = AgentCard()
    result.CopyFrom(card)
    kept = [i for i in card.supported_interfaces if i.protocol_binding != "GRPC"]
    del result.supported_interfaces[:]
    result.supported_interfaces.append(
        AgentInterface(url=address, protocol_binding="GRPC", protocol_version=PROTOCOL_VERSION)
    )
    result.supported_interfaces.extend(kept)
    return result


def with_capabilities(card: AgentCard, *, push_notifications: bool) -> AgentCard:
    """A copy of ``card`` whose capabilities say what this server serves (push on or off)."""
    result = AgentCard()
    result.CopyFrom(card)
    result.capabilities.push_notifications = push_notifications
    return result


def with_security(card: AgentCard, name: str, scheme: SecurityScheme) -> AgentCard:
    """A copy of ``card`` saying that every call needs ``scheme`` (what ``auth`` enforces)."""
    result = AgentCard()
    result.CopyFrom(card)
    result.security_schemes[name].CopyFrom(scheme)
    del result.security_requirements[:]
    requirement = result.security_requirements.add()
    requirement.schemes[name].SetInParent()
    return result


def with_extended_card(card: AgentCard) -> AgentCard:
    """A copy of ``card`` saying that authenticated callers get an extended card."""
    result = AgentCard()
    result.CopyFrom(card)
    result.capabilities.extended_agent_card = True
    return result


def with_extension(card: AgentCard, extension: AgentExtension) -> AgentCard:
    """Return a copy of ``card`` declaring ``extension`` (replacing one of the same URI)."""
    result = AgentCard()
    result.CopyFrom(card)
    kept = [e for e in card.capabilities.extensions if e.uri != extension.uri]
    del result.capabilities.extensions[:]
    result.capabilities.extensions.extend([*kept, extension])
    return result
