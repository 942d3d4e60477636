"""The implementation: not a public API, and free to change in any release.

What embedders use is exported from ``a2a_grpc_server`` and its public modules
(``auth``, ``cluster``, ``testing``, ``agents.echo``; docs/reference/api.md), each
with ``__all__``. The packages here are the layers, each importing only
downward (pyproject.toml's import-linter contracts); none imports the public
modules.

Loggers keep the names they had before the move, without ``._internal``
(``logging.getLogger(__name__.replace("._internal", ""))``): logging
configurations and log lines name ``a2a_grpc_server.jetstream.conn``, say.
"""
