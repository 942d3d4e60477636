"""The nats-server processes of the tests: ``a2a_grpc_server.testing._nats`` (public, for
embedders' tests too)."""

from a2a_grpc_server.testing._nats import Cluster, Node, binary, free_port, running

__all__ = ["Cluster", "Node", "binary", "free_port", "running"]
