"""The public API is what ``__all__`` names in the public modules, and docs/reference/api.md
documents exactly those names. Every other module is private by name (``_internal``,
``testing._nats``). The examples and the docs import only public modules, so they keep
working when the implementation moves, as it did into ``_internal``."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from typing import Any

import pytest

import a2a_grpc_server
from tests.support import ROOT, script

PUBLIC_MODULES = (
    "a2a_grpc_server",
    "a2a_grpc_server.cluster",
    "a2a_grpc_server.auth",
    "a2a_grpc_server.testing",
    "a2a_grpc_server.agents.echo",
)
"""The modules whose ``__all__`` is the API (docs/reference/api.md, in this order)."""

ENTRY_POINTS = ("a2a_grpc_server.cli", "a2a_grpc_server.healthcheck", "a2a_grpc_server.agents")
"""Public by name but not API: the console script, the health probe, the agents' package."""

REFERENCE = re.compile(r"^::: (a2a_grpc_server[\w.]*)$", re.M)
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def exported() -> set[str]:
    """Every public name, as ``module.name``."""
    return {f"{m}.{n}" for m in PUBLIC_MODULES for n in importlib.import_module(m).__all__}


def all_modules() -> list[str]:
    """Every module of the package, imported or not."""
    prefix = a2a_grpc_server.__name__ + "."
    found = [a2a_grpc_server.__name__]
    for info in pkgutil.walk_packages(a2a_grpc_server.__path__, prefix, onerror=lambda _: None):
        found.append(info.name)
    return found


def test_every_module_is_public_or_private_by_name() -> None:
    modules = all_modules()
    assert len(modules) > 80, "the walk found the implementation too"
    for name in modules:
        private = any(part.startswith("_") for part in name.split("."))
        assert private or name in PUBLIC_MODULES + ENTRY_POINTS, (
            f"{name} is neither a public module nor private by name: move it under _internal"
        )


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_a_public_module_exports_what_it_defines_and_nothing_more(name: str) -> None:
    module = importlib.import_module(name)
    names = module.__all__
    assert len(names) == len(set(names)), f"{name}.__all__ repeats a name"
    for member in names:
        assert hasattr(module, member), f"{name}.__all__ names {member}, which it lacks"
    defined = set()
    for node in ast.parse(pathlib.Path(module.__file__ or "").read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    public = {d for d in defined if not d.startswith("_")}
    assert public <= set(names), (
        f"{name} defines public names outside __all__: {public - set(names)}"
    )


def test_the_api_reference_documents_exactly_the_public_names() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = REFERENCE.findall(page)
    assert len(documented) == len(set(documented)), "docs/reference/api.md repeats a name"
    assert set(documented) == exported(), (
        f"documented, not exported: {sorted(set(documented) - exported())}; "
        f"exported, not documented: {sorted(exported() - set(documented))}"
    )


OPAQUE = {
    ("A2AServer.__init__", "journal"): "tests pass their own stores; users leave it None",
    ("A2AService.__init__", "journal"): "tests pass their own stores; users leave it None",
    ("A2AService.__init__", "cluster"): "takes a NatsCluster (the port it implements)",
}
"""Parameters whose type is the implementation's, on purpose (their docstrings say so)."""


def every_class() -> dict[str, type]:
    """Every class of the package by name, to resolve names imported for type checking."""
    found: dict[str, type] = {}
    for name in all_modules():
        for attr, value in vars(importlib.import_module(name)).items():
            if isinstance(value, type) and value.__module__.startswith("a2a_grpc_server"):
                found.setdefault(attr, value)
    return found


def classes_in(hint: object) -> Iterator[type]:
    """The classes a type hint names, nested ones included."""
    if isinstance(hint, type):
        yield hint
    for arg in typing.get_args(hint):
        yield from classes_in(arg)


def documented_callables() -> Iterator[tuple[str, Any]]:
    """(name, function) of every public function, and of the public members of every
    public class that the API page documents (``__init__`` unless the members are listed)."""
    members = script("api_reference").MEMBERS
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if not inspect.isclass(obj):
                if callable(obj):
                    yield name, obj
                continue
            listed = members.get(f"{module_name}.{name}")
            for attr, value in inspect.getmembers(obj):
                wanted = (
                    attr in listed if listed else attr == "__init__" or not attr.startswith("_")
                )
                if wanted and isinstance(value, property) and value.fget is not None:
                    yield f"{name}.{attr}", value.fget
                elif wanted and callable(value):
                    yield f"{name}.{attr}", value


def test_the_public_api_takes_and_gives_only_public_types() -> None:
    public = {
        id(getattr(importlib.import_module(m), n))
        for m in PUBLIC_MODULES
        for n in importlib.import_module(m).__all__
    }
    namespace = every_class()
    private = []
    seen = 0
    for where, function in documented_callables():
        for parameter, hint in typing.get_type_hints(function, localns=namespace).items():
            seen += 1
            for cls in classes_in(hint):
                internal = cls.__module__.startswith("a2a_grpc_server") and id(cls) not in public
                if internal and (where, parameter) not in OPAQUE:
                    private.append(f"{where}({parameter}): {cls.__module__}.{cls.__qualname__}")
    assert seen > 50, "the walk read the signatures"
    assert private == [], "public signatures name private types:\n" + "\n".join(private)


def test_the_api_reference_is_the_generated_one() -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "api_reference"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr


def imports(source: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) of every ``from a2a_grpc_server… import …`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("a2a_grpc_server"):
            found.append((node.module or "", tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names if a.name.startswith("a2a_grpc_server")]
    return found


def sources() -> list[tuple[str, str]]:
    """Every example, and every Python block of the README and the docs pages."""
    found = [(str(p.relative_to(ROOT)), p.read_text()) for p in (ROOT / "examples").rglob("*.py")]
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, block in enumerate(PYTHON_BLOCK.findall(page.read_text())):
            found.append((f"{page.relative_to(ROOT)} (block {i + 1})", block))
    return [(name, text) for name, text in found if "gen/" not in name]


def test_examples_and_docs_import_only_the_public_api() -> None:
    seen = 0
    for where, text in sources():
        for module, names in imports(text):
            seen += 1
            assert module in PUBLIC_MODULES + ENTRY_POINTS, f"{where} imports {module}, not public"
            loaded = importlib.import_module(module)
            for name in names:
                assert name in getattr(loaded, "__all__", ()), (
                    f"{where}: {module} exports no {name}"
                )
    assert seen >= 8, "the examples and the docs do import the package"
