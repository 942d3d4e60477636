"""The table of every error the server answers, generated from the error tree.

``docs/reference/errors.md`` holds it between markers; a test keeps it current
(``scripts/errors_table`` rewrites it). Protocol errors are a2a-sdk's, with the
status and reason its ``A2A_ERROR_MAPPING`` gives them; the server's own are
every subclass of ``errors.ServerError`` in the package, with the status and
reason they carry (``errors.to_status`` is the one place either is sent).
"""

from __future__ import annotations

import importlib
import pkgutil

from a2a.utils.errors import A2A_ERROR_MAPPING

from .. import errors

PACKAGE = "a2a_grpc_server"


def _summary(cls: type) -> str:
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    return " ".join(doc.split()).replace("|", "\\|")


def _server_errors() -> list[type[errors.ServerError]]:
    """Every ``ServerError`` subclass of the package (each module imported to find them)."""
    package = importlib.import_module(PACKAGE)
    for info in pkgutil.walk_packages(package.__path__, f"{PACKAGE}."):
        importlib.import_module(info.name)
    found: list[type[errors.ServerError]] = []
    pending = list(errors.ServerError.__subclasses__())
    while pending:
        cls = pending.pop()
        if cls.__module__.startswith(PACKAGE) and cls not in found:
            found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def markdown() -> str:
    """The table, one row per error: status, reason, domain, class and what it means."""
    rows = [
        (
            mapping.grpc_status,
            mapping.reason,
            errors.A2A_DOMAIN,
            f"`{cls.__name__}` (a2a-sdk)",
            _summary(cls),
        )
        for cls, mapping in A2A_ERROR_MAPPING.items()
    ]
    rows += [
        (
            cls.code.name,
            reason,
            errors.SERVER_DOMAIN,
            f"`{cls.__name__}`",
            _summary(cls),
        )
        for cls in _server_errors()
        # (An error whose reason depends on the case lists every one it may carry.)
        for reason in getattr(cls, "reasons", (cls.reason,))
    ]
    rows.append(
        (
            "INTERNAL",
            "INTERNAL",
            errors.SERVER_DOMAIN,
            "anything else",
            "A generic message; the traceback is in the server log.",
        )
    )
    lines = ["| status | reason | domain | error | what it means |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in sorted(set(rows))]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # the table: python -m a2a_grpc_server._internal.app.errortable
    print(markdown(), end="")
