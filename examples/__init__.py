"""Runnable example agents (see README)."""
