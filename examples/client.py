"""A synchronous Python client on stubs generated from this repository's ``proto/``.

    python -m examples.client 127.0.0.1:50051 "hello" [--token TOKEN]

It generates the stubs itself when they are missing (``generate()``). By
hand, from the checkout: the commands under "With stubs generated from proto/"
in docs/how-to/call.md, which a test runs as written (they find googleapis' protos
through ``google.api.annotations_pb2``: ``google.api.__file__`` is None).

``ask`` sends one message and waits for the task's outcome, and shows how a
client handles each status the server answers (docs/reference/errors.md):

* OK: the task (or the agent's message);
* UNAVAILABLE (the instance is draining, or the task's owner is out of
  reach) and RESOURCE_EXHAUSTED for a quota: retried with backoff, a bounded
  number of times (a quota frees as the caller's other work ends);
* DEADLINE_EXCEEDED: not retried blindly, the message may have been taken
  (look the task up before sending again);
* UNAUTHENTICATED, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION and the
  rest: not retried; the ``ErrorInfo`` reason and the field at fault are
  reported.

The stub and message modules are parameters, so the same code runs on stubs
generated from ``proto/`` (``lf.a2a.v1``) or on a2a-sdk's
(``a2a.types.a2a_pb2``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

VERSION = (("a2a-version", "1.0"),)
SAFE_RETRIES = (("a2a-extensions", "urn:a2a-grpc-server:extension:idempotency:v1"),)
"""Ask the server to run a retried message once (its id is the key)."""
RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
QUOTAS = {"LIVE_TASKS_QUOTA", "PARKED_TASKS_QUOTA", "STREAMS_QUOTA", "SUBSCRIBERS_QUOTA"}
GENERATED = Path(__file__).resolve().parent / "gen"


class ClientError(Exception):
    """The server refused the message; what a person can act on.

    Attributes:
        code: The gRPC status.
        reason: The ``ErrorInfo`` reason ("" if none).
        field: The request field at fault ("" if none).
    """

    def __init__(self, code: grpc.StatusCode, reason: str, field: str, text: str) -> None:
        super().__init__(f"{code.name} {reason}: {text}" + (f" (field {field})" if field else ""))
        self.code, self.reason, self.field = code, reason, field


@dataclass
class Outcome:
    """What ``ask`` got: a task or the agent's message, and how many attempts it took."""

    task: Any
    message: Any
    attempts: int


def details(error: grpc.RpcError) -> tuple[str, str]:
    """The ``ErrorInfo`` reason and the ``BadRequest`` field of a failed call."""
    reason = field = ""
    for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
        if key != "grpc-status-details-bin":
            continue
        for detail in status_pb2.Status.FromString(value).details:
            info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
            if detail.Unpack(info):
                reason = info.reason
            elif detail.Unpack(bad) and bad.field_violations:
                field = bad.field_violations[0].field
    return reason, field


def ask(
    stub: Any,
    pb2: ModuleType,
    text: str,
    *,
    token: str | None = None,
    timeout: float = 30.0,
    attempts: int = 4,
    backoff: float = 0.25,
) -> Outcome:
    """Send ``text`` as a new task and wait for its outcome (see the module docstring).

    Raises:
        ClientError: The server refused it (after the retries, for the statuses retried).
    """
    metadata = VERSION + SAFE_RETRIES + ((("authorization", f"Bearer {token}"),) if token else ())
    request = pb2.SendMessageRequest(
        message=pb2.Message(
            # The same id on every retry: with SAFE_RETRIES in the metadata, a retry of
            # a message the server already took is answered its task, never run twice
            # (docs/how-to/retries.md).
            message_id=str(uuid.uuid4()),
            role=pb2.ROLE_USER,
            parts=[pb2.Part(text=text)],
        )
    )
    for attempt in range(1, attempts + 1):
        try:
            answer = stub.SendMessage(request, metadata=metadata, timeout=timeout)
        except grpc.RpcError as error:
            code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
            reason, field = details(error)
            retry = code == grpc.StatusCode.UNAVAILABLE or reason in QUOTAS
            if not retry or attempt == attempts:
                text_ = error.details() or ""  # type: ignore[attr-defined]
                raise ClientError(code, reason, field, text_) from None
            time.sleep(backoff * 2 ** (attempt - 1))
            continue
        if answer.HasField("message"):
            return Outcome(None, answer.message, attempt)
        return Outcome(answer.task, None, attempt)
    raise AssertionError("unreachable")


def generate(into: Path = GENERATED) -> None:
    """Generate the stubs of ``proto/`` into ``into`` (needs grpcio-tools)."""
    import grpc_tools
    from google.api import annotations_pb2

    root = Path(__file__).resolve().parent.parent
    includes = [
        root / "proto",
        Path(os.path.dirname(grpc_tools.__file__)) / "_proto",
        Path(os.path.dirname(annotations_pb2.__file__)).parent.parent,
    ]
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            *(f"-I{p}" for p in includes),
            f"--python_out={into}",
            f"--grpc_python_out={into}",
            "lf/a2a/v1/a2a.proto",
        ],
        check=True,
    )


def stubs(into: Path = GENERATED) -> tuple[ModuleType, ModuleType]:
    """The generated ``a2a_pb2`` and ``a2a_pb2_grpc`` (generated first if missing)."""
    if not (into / "lf" / "a2a" / "v1" / "a2a_pb2.py").exists():
        generate(into)
    sys.path.insert(0, str(into))
    return importlib.import_module("lf.a2a.v1.a2a_pb2"), importlib.import_module(
        "lf.a2a.v1.a2a_pb2_grpc"
    )


def main(argv: list[str] | None = None) -> int:
    """Send one message; print the outcome, or why it was refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("text")
    parser.add_argument("--token")
    parser.add_argument("--stubs", type=Path, default=GENERATED, help="where the stubs go")
    args = parser.parse_args(argv)
    pb2, pb2_grpc = stubs(args.stubs)
    with grpc.insecure_channel(args.address) as channel:  # type: ignore[no-untyped-call]
        try:
            outcome = ask(pb2_grpc.A2AServiceStub(channel), pb2, args.text, token=args.token)
        except ClientError as exc:
            print(f"refused: {exc}", file=sys.stderr)
            return 1
    if outcome.task is not None:
        state = pb2.TaskState.Name(outcome.task.status.state)
        print(f"task {outcome.task.id}: {state} after {outcome.attempts} attempt(s)")
    else:
        print(f"message: {outcome.message.parts[0].text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
