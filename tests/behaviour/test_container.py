"""What the container image runs, checked without a Docker engine (none runs here): the wheel
the Dockerfile builds holds every module, the image runs as a non-root user, and its health
probe tells a serving server from one that is not."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import zipfile
from pathlib import Path

from a2a_grpc_server._internal.app.healthcheck import check
from a2a_grpc_server.testing._nats import free_port
from tests.support import ROOT
from tests.support.serveproc import start


def test_the_dockerfile_runs_serve_as_a_non_root_user_with_a_health_probe() -> None:
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and not users[-1].startswith(("0", "root")), "the last USER is not root"
    assert any("a2a_grpc_server.healthcheck" in line for line in lines)
    assert lines[-1] == 'ENTRYPOINT ["a2a-grpc-server", "serve"]'


def test_the_wheel_holds_every_module(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("a2a_grpc_server-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = ROOT / "server" / "a2a_grpc_server"
    modules = {str(p.relative_to(package.parent)) for p in package.rglob("*.py")}
    assert modules <= names, modules - names
    assert "a2a_grpc_server/py.typed" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "a2a-grpc-server = a2a_grpc_server.cli:main" in text


async def test_the_health_probe_tells_serving_from_not() -> None:
    server = await start()
    try:
        assert await asyncio.to_thread(check, server.grpc_addr)
        assert await asyncio.to_thread(check, server.grpc_addr, "")
        assert not await asyncio.to_thread(check, server.grpc_addr, "no.such.Service")
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "a2a_grpc_server.healthcheck", "--address", server.grpc_addr
        )
        assert await done.wait() == 0
    finally:
        server.proc.kill()
        await server.proc.wait()
    assert not await asyncio.to_thread(check, f"127.0.0.1:{free_port()}", timeout=1.0)
