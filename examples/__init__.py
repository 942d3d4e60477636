"""Runnable example agents (see docs/examples.md)."""
