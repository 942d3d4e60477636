"""Cluster mode, for embedders: several instances on NATS JetStream.

It needs the ``cluster`` extra: ``pip install 'a2a-grpc-server[cluster]'``.

``NatsConfig`` says how to reach NATS and what to create there; ``NatsCluster``
is what ``A2AServer`` runs on it, for an embedder that builds the service itself
(docs/how-to/embed.md). The command line (``serve --nats``) needs neither.
"""

from __future__ import annotations

from ._internal.jetstream.natsconfig import NatsConfig
from ._internal.jetstream.node import NatsCluster

__all__ = ["NatsCluster", "NatsConfig"]
