"""Importing the package leaves the process's environment alone: no ``OTEL_*`` default (or any
other variable) is set in an embedder's process, whatever module of ours it imports."""

from __future__ import annotations

import json
import subprocess
import sys

EVERY_MODULE = """
import importlib, json, os, pkgutil
before = dict(os.environ)
import a2a_grpc_server
names = [m.name for m in pkgutil.walk_packages(a2a_grpc_server.__path__, "a2a_grpc_server.")]
for name in names:
    importlib.import_module(name)
import a2a.utils.telemetry as sdk
after = dict(os.environ)
print(json.dumps({
    "modules": len(names),
    "changed": sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)),
    "sdk_spans_on": sdk.otel_enabled,
}))
"""


def test_importing_every_module_of_the_package_leaves_the_environment_unchanged() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EVERY_MODULE],
        env={},  # a clean environment: nothing set that a default could hide behind
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["modules"] > 50, "every module was imported"
    assert seen["changed"] == [], "importing a2a_grpc_server set or changed these variables"
    assert seen["sdk_spans_on"], "a2a-sdk's own spans stay as the application left them (on)"
