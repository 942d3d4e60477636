"""Agents bundled with the server (the default ``serve`` agent lives here)."""
