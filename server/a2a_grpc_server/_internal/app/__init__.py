"""The process: ``A2AService``, ``A2AServer``, the HTTP side, the card, the CLI, settings.

The top of the layers (see docs/explanation/architecture.md). Embedders use what the
public modules export (docs/reference/api.md); the modules here are the
implementation and may move.
"""
