"""Fixtures of the JetStream spikes (issue 41): a cluster per module and a client of it."""

from tests.support.spikes import cluster, nc

__all__ = ["cluster", "nc"]
