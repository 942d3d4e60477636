"""The gRPC face: the servicer, request checks, the resume extension, interceptors, authentication.

Embedders use ``a2a_grpc_server.auth`` for authentication (it re-exports
``rpc.auth``); the rest is internal.
"""
