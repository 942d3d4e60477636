"""examples/client.py: its handling of each status, played by grpcio-testing's fake channel
(the server's side scripted call by call), and the example itself against a real server on
stubs generated from proto/."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import grpc_testing  # type: ignore[import-untyped]
import pytest
from a2a.types import a2a_pb2, a2a_pb2_grpc
from examples.client import ClientError, Outcome, ask
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from a2a_grpc_server.agents.echo import EchoAgent
from tests.support import ROOT
from tests.support.harness import serve

SERVICE = a2a_pb2.DESCRIPTOR.services_by_name["A2AService"]
SEND = SERVICE.methods_by_name["SendMessage"]
OK = grpc.StatusCode.OK
Play = tuple[grpc.StatusCode, str, str]
"""One answer of the fake server: status, ErrorInfo reason, BadRequest field."""


def trailers(reason: str, field: str) -> tuple[tuple[str, bytes], ...]:
    if not reason:
        return ()
    status = status_pb2.Status()
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="a2a-grpc-server"))
    status.details.append(detail)
    if field:
        bad = error_details_pb2.BadRequest()
        bad.field_violations.add(field=field, description="wrong")
        detail = any_pb2.Any()
        detail.Pack(bad)
        status.details.append(detail)
    return (("grpc-status-details-bin", status.SerializeToString()),)


def play(answers: Sequence[Play]) -> tuple[Future[Outcome], list[Any]]:
    """Run ``ask`` against a fake channel that answers its calls with ``answers``, in order."""
    channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
    stub = a2a_pb2_grpc.A2AServiceStub(channel)
    requests: list[Any] = []
    pool = ThreadPoolExecutor(1)
    future = pool.submit(ask, stub, a2a_pb2, "hi", backoff=0.0)
    for code, reason, field in answers:
        metadata, request, rpc = channel.take_unary_unary(SEND)
        requests.append((dict(metadata), request))
        task = a2a_pb2.Task(id="t1", status=a2a_pb2.TaskStatus(state=a2a_pb2.TASK_STATE_COMPLETED))
        response = a2a_pb2.SendMessageResponse(task=task) if code == OK else None
        rpc.terminate(response, trailers(reason, field), code, f"{code.name} from the fake")
    pool.shutdown(wait=True)
    return future, requests


def test_ok_gives_the_task_and_sends_the_version() -> None:
    future, requests = play([(OK, "", "")])
    outcome = future.result(timeout=10)
    assert (outcome.task.id, outcome.attempts) == ("t1", 1)
    assert requests[0][0]["a2a-version"] == "1.0"


def test_unavailable_and_a_quota_are_retried_with_the_same_message() -> None:
    future, requests = play(
        [
            (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN", ""),
            (grpc.StatusCode.RESOURCE_EXHAUSTED, "STREAMS_QUOTA", ""),
            (OK, "", ""),
        ]
    )
    assert future.result(timeout=10).attempts == 3
    ids = {request.message.message_id for _, request in requests}
    assert len(ids) == 1, "a retry resends the same message, not a new one"


@pytest.mark.parametrize(
    ("code", "reason", "field"),
    [
        (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", ""),
        (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_PARAMS", "message.parts"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "ANSWER_TOO_LARGE", ""),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "OWNER_TIMEOUT", ""),
        (grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND", ""),
    ],
)
def test_other_refusals_are_reported_at_once(
    code: grpc.StatusCode, reason: str, field: str
) -> None:
    future, _ = play([(code, reason, field)])
    with pytest.raises(ClientError) as caught:
        future.result(timeout=10)
    assert (caught.value.code, caught.value.reason, caught.value.field) == (code, reason, field)


def test_retries_are_bounded() -> None:
    future, requests = play([(grpc.StatusCode.UNAVAILABLE, "OWNER_UNAVAILABLE", "")] * 4)
    with pytest.raises(ClientError) as caught:
        future.result(timeout=10)
    assert caught.value.reason == "OWNER_UNAVAILABLE" and len(requests) == 4


async def test_the_example_runs_against_a_server_on_stubs_generated_from_proto(
    tmp_path: Path,
) -> None:
    async with asyncio.timeout(60), serve(EchoAgent()) as h:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "examples.client",
            h.address,
            "hello",
            "--stubs",
            str(tmp_path / "gen"),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()[-500:]
        assert out.decode().strip().endswith("TASK_STATE_COMPLETED after 1 attempt(s)")
        assert (tmp_path / "gen" / "lf" / "a2a" / "v1" / "a2a_pb2_grpc.py").exists()
        await h.settle()
