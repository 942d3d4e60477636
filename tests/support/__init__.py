"""The one support package of the tests: how to start servers, agents, fixtures' helpers."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (where ``pyproject.toml`` is)."""
