"""The one support package of the tests: how to start servers, agents, fixtures' helpers."""

import functools
import importlib.machinery
import importlib.util
import os
import secrets
import tempfile
from pathlib import Path
from types import ModuleType

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


def script(name: str) -> ModuleType:
    """``scripts/<name>``, imported as a module (the scripts have no ``.py`` suffix)."""
    loader = importlib.machinery.SourceFileLoader(name, str(ROOT / "scripts" / name))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
