"""The process: ``A2AService``, ``A2AServer``, the HTTP side, the card, the CLI, settings.

The top of the layers (see docs/explanation/architecture.md). Embedders use what the
package's top level re-exports (``a2a_grpc_server.A2AService``, ``A2AServer``,
``grpc_options``); the modules here are the implementation and may move.
"""
