"""Cluster mode uses nats-py's public API only, so ``pyproject.toml`` may allow any 2.x
from the version tested (``nats-py>=2.16,<3``).

The lesson behind it: a library's private internals need a pinned range and a check at
start-up. ``jetstream`` has none left (the coalescing client, ``bucket_of`` and the
swapped ``_error_cb`` were the last), and this keeps it so: a private attribute reached
through anything but ``self`` or ``cls`` fails here, naming where.
"""

from __future__ import annotations

import ast

from tests.support import ROOT

PACKAGE = ROOT / "server" / "a2a_grpc_server" / "jetstream"


def private_reaches(source: str) -> list[tuple[int, str]]:
    """Each ``x._name`` in ``source`` whose ``x`` is not ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_a_private_reach() -> None:
    assert private_reaches("def f(kv):\n    return kv._js\n") == [(2, "kv._js")]
    assert private_reaches("class A:\n    def f(self):\n        return self._x\n") == []


def test_jetstream_reaches_into_nothing_private() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) > 20
    reaches = {
        f"{path.name}:{line}": text
        for path in files
        for line, text in private_reaches(path.read_text())
    }
    assert reaches == {}
