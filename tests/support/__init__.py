"""The one support package of the tests: how to start servers, agents, fixtures' helpers."""

import functools
import os
import secrets
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root (where ``pyproject.toml`` is)."""

CLUSTER_KEY = secrets.token_hex(32).encode()
"""The cluster key every instance of this test run shares (routed requests are signed)."""


@functools.cache
def cluster_key_file() -> Path:
    """A file holding ``CLUSTER_KEY`` (readable by its owner only), for ``serve`` processes."""
    directory = Path(tempfile.mkdtemp(prefix="a2a-test-key-"))
    path = directory / "cluster.key"
    path.write_bytes(CLUSTER_KEY)
    os.chmod(path, 0o600)
    return path
