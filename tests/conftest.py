"""Shared fixtures: every test runs against a real server; see ``harness``."""

from __future__ import annotations

import logging

logging.getLogger("a2a_grpc_server").setLevel(logging.DEBUG)
