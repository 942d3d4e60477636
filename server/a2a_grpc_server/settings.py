"""``ServerConfig`` settings as command-line flags, declared once: by the dataclass field.

A field ``quota_live_tasks`` becomes the flag ``--quota-live-tasks``, of the
field's type, with the field's default, and its help is the field's entry in
``ServerConfig``'s docstring; nothing about a setting is written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from typing import Any

from .config import ServerConfig

_ENTRY = re.compile(r"^ {4}(\w+): (.*)$")


def descriptions() -> dict[str, str]:
    """Each ``ServerConfig`` attribute's description, from the class docstring."""
    doc = inspect.cleandoc(ServerConfig.__doc__ or "")
    found: dict[str, str] = {}
    name = ""
    in_attributes = False
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attributes = True
            continue
        if not in_attributes:
            continue
        entry = _ENTRY.match(line)
        if entry:
            name = entry.group(1)
            found[name] = entry.group(2)
        elif name and line.startswith(" " * 8):
            found[name] += " " + line.strip()
    return found


def add_flags(group: Any, prefix: str) -> None:
    """Add a flag to ``group`` for every ``ServerConfig`` field named ``prefix...``.

    Args:
        group: An ``argparse`` parser or argument group.
        prefix: The fields' common prefix, e.g. ``quota_``.
    """
    text = descriptions()
    for field in dataclasses.fields(ServerConfig):
        if not field.name.startswith(prefix):
            continue
        default = field.default
        kind = type(default)
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=kind,
            default=default,
            metavar="N" if kind is int else "SECONDS",
            help=f"{text.get(field.name, '')} (default {default})".replace("%", "%%"),
        )


def chosen(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The values of the flags ``add_flags(..., prefix)`` added, as ``ServerConfig`` keywords."""
    return {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(ServerConfig)
        if field.name.startswith(prefix)
    }
