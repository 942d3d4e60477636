"""Observability: counters (``metrics``), log lines (``logs``), spans (``tracing``).

Internal: not API (metrics are read through ``A2AService.collector()``).
"""
