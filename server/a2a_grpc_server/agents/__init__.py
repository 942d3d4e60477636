"""Agents bundled with the server (the default ``serve`` agent lives here)."""

__all__: list[str] = []
