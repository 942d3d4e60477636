"""The public API is what docs/reference.md documents, and it is all the examples and the
docs use: every documented name imports from its documented path, and every import of the
package in examples/, README.md and docs/ is of a documented module (the rest of the package
is implementation and may move, as it did when the packages became the layers)."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from tests.support import ROOT

PUBLIC_MODULES = {
    "a2a_grpc_server",
    "a2a_grpc_server.auth",
    "a2a_grpc_server.testing",
    "a2a_grpc_server.jetstream.natsconfig",
    "a2a_grpc_server.jetstream.node",
    "a2a_grpc_server.agents.echo",
    "a2a_grpc_server.cli",
    "a2a_grpc_server.healthcheck",
}
"""The modules docs/reference.md documents, the bundled agent, and the two entry points."""

REFERENCE = re.compile(r"^::: (a2a_grpc_server[\w.]*)$", re.M)
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def documented() -> list[str]:
    return REFERENCE.findall((ROOT / "docs" / "reference.md").read_text())


def imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every ``from a2a_grpc_server… import …`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("a2a_grpc_server"):
            found.append((node.module or "", tuple(alias.name for alias in node.names)))
    return found


def sources() -> list[tuple[str, str]]:
    """Every example, and every Python block of the README and the docs pages."""
    found = [(str(p.relative_to(ROOT)), p.read_text()) for p in (ROOT / "examples").rglob("*.py")]
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for i, block in enumerate(PYTHON_BLOCK.findall(page.read_text())):
            found.append((f"{page.relative_to(ROOT)} (block {i + 1})", block))
    return [(name, text) for name, text in found if "gen/" not in name]


@pytest.mark.parametrize("path", documented())
def test_every_documented_name_imports_from_its_documented_path(path: str) -> None:
    module, _, name = path.rpartition(".")
    try:
        target = importlib.import_module(path)
    except ModuleNotFoundError:
        target = getattr(importlib.import_module(module), name)
    assert target is not None
    assert path in PUBLIC_MODULES or module in PUBLIC_MODULES, f"{path} is not a public module"


def test_examples_and_docs_import_only_the_public_api() -> None:
    seen = 0
    for where, text in sources():
        for module, names in imports(text):
            seen += 1
            assert module in PUBLIC_MODULES, f"{where} imports {module}, not a public module"
            loaded = importlib.import_module(module)
            for name in names:
                assert hasattr(loaded, name), f"{where}: {module} has no {name}"
    assert seen >= 8, "the examples and the docs do import the package"
