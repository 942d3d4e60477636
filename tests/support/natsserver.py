"""The nats-server processes of the tests: ``a2a_grpc_server.testing``'s (``nats_server``,
``NatsServers`` and ``NatsNode`` are public, for embedders' tests too), by the names the
tests use."""

from a2a_grpc_server.testing import NatsNode as Node
from a2a_grpc_server.testing import NatsServers as Cluster
from a2a_grpc_server.testing._nats import binary, free_port, running

__all__ = ["Cluster", "Node", "binary", "free_port", "running"]
