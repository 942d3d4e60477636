"""Runnable example agents (see docs/how-to/conformance.md)."""
