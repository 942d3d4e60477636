"""The committed samples of every shared format (tests/fixtures/formats), and how they are made.

``python -m tests.support.formatfixtures`` (``scripts/format_fixtures``) writes them from
the current code; the test of the formats checks that today's writers still make exactly
these bytes, and that today's readers read them all. A sample of a format is committed
once and never rewritten by hand: a reader of a later version must read it as it is.

Each sample is JSON: ``headers`` (for a message) and ``data`` (base64).
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

from a2a.types.a2a_pb2 import (
    Artifact,
    Message,
    Part,
    Role,
    StreamResponse,
    Task,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)

from a2a_grpc_server._internal.jetstream import formats, pushstore, tasklog
from a2a_grpc_server._internal.jetstream.records import encode
from a2a_grpc_server._internal.jetstream.records import messages as _messages
from a2a_grpc_server._internal.journal import Change
from tests.support import ROOT

DIR = ROOT / "tests" / "fixtures" / "formats"
TASK_ID = "0b8f4c2e-6d2a-4f0e-9b65-5f2f9c1d7a10"
OWNER = "instance-a"
LOG_WHERE = tasklog.Where(TASK_ID, OWNER, "t:alice", "ctx-1")
"""Where the samples of the task log (format 3) were written."""


def sample_task() -> Task:
    """The task every sample carries: INPUT_REQUIRED, one artifact, one message."""
    status = TaskStatus(
        state=TaskState.TASK_STATE_INPUT_REQUIRED,
        message=Message(message_id="m1", role=Role.ROLE_AGENT, parts=[Part(text="your name?")]),
    )
    status.timestamp.FromSeconds(1_764_547_200)
    return Task(
        id=TASK_ID,
        context_id="ctx-1",
        status=status,
        artifacts=[Artifact(artifact_id="a1", parts=[Part(text="half done")])],
    )


def sample_changes() -> list[Change]:
    """Two changes: a status frame, and a follow-up user message (a change without a frame)."""
    task = sample_task()
    update = TaskStatusUpdateEvent(task_id=TASK_ID, context_id="ctx-1", status=task.status)
    frame = StreamResponse(status_update=update)
    message = Message(message_id="m2", role=Role.ROLE_USER, task_id=TASK_ID)
    message.parts.append(Part(text="Ada"))
    return [
        Change(3, frame.SerializeToString(), TaskState.TASK_STATE_INPUT_REQUIRED),
        Change(4, b"", 0, message=message),
    ]


def sample_config() -> TaskPushNotificationConfig:
    return TaskPushNotificationConfig(
        task_id=TASK_ID, id="hook-1", url="https://hooks.example/a2a", token="t0ken"
    )


def samples() -> dict[str, dict[str, object]]:
    """Every sample, by file name (without ``.json``)."""
    task = sample_task()
    found: dict[str, dict[str, object]] = {}
    for fmt in (formats.LEGACY, formats.CURRENT):
        found[f"snapshot-{fmt}"] = _value(encode(OWNER, task, 3, 7, "t:alice", fmt))
        value = pushstore._pack(1_700_000_000_000_000_000, 3, OWNER, sample_config())
        found[f"push-config-{fmt}"] = _value(formats.mark(value, fmt))
        # (Without the message id's nonce: it is random per write, and no reader but the
        # writer's own retry compares it.)
        [(_, payload, headers)] = _messages(
            TASK_ID, sample_changes(), 1 << 20, OWNER, fmt, nonce=""
        )
        if fmt == formats.LEGACY:
            del headers[formats.HEADER]  # (as versions before formats wrote it)
        found[f"record-{fmt}"] = {"headers": headers, "data": _b64(payload)}
    found["heartbeat-1"] = _value(b"")
    found["heartbeat-2"] = {"data": _b64(b'{"formats": [1, 2], "version": "0.0.0"}')}
    found["heartbeat-3"] = {"data": _b64(b'{"formats": [1, 2, 3], "version": "0.0.0"}')}
    # Format 3, the task log: an s (the changes, then the task) and an e (changes only).
    for kind, snapshot in (("s", task), ("e", None)):
        changes = sample_changes() if snapshot is not None else sample_changes()[1:]
        _, payload, headers = tasklog.encode(changes, snapshot, LOG_WHERE, OWNER, nonce="n0")
        found[f"log-3-{kind}"] = {"headers": headers, "data": _b64(payload)}
    return found


def future_samples() -> dict[str, dict[str, object]]:
    """Samples of a format no version reads yet (9), and of kinds no version knows."""
    legacy = samples()
    snapshot = base64.b64decode(str(legacy["snapshot-1"]["data"]))
    config = base64.b64decode(str(legacy["push-config-1"]["data"]))
    record = dict(legacy["record-2"])
    headers = dict(record["headers"])  # type: ignore[call-overload]
    payload = bytearray(base64.b64decode(str(record["data"])))
    payload[0] = ord("x")  # a change of a kind no version writes
    log = dict(legacy["log-3-s"])
    log_headers = dict(log["headers"])  # type: ignore[call-overload]
    return {
        "log-9": {"headers": {**log_headers, formats.HEADER: "9"}, "data": log["data"]},
        "snapshot-9": _value(formats.MAGIC + b"9\n" + snapshot),
        "push-config-9": _value(formats.MAGIC + b"9\n" + config),
        "record-9": {"headers": {**headers, formats.HEADER: "9"}, "data": record["data"]},
        "record-kind-x": {"headers": headers, "data": _b64(bytes(payload))},
    }


def load(name: str) -> tuple[dict[str, str], bytes]:
    """A committed sample: its headers and its bytes."""
    found = json.loads((DIR / f"{name}.json").read_text())
    return dict(found.get("headers", {})), base64.b64decode(found["data"])


def write(directory: Path = DIR) -> list[str]:
    """Write every sample; return the names written."""
    directory.mkdir(parents=True, exist_ok=True)
    every = {**samples(), **future_samples()}
    for name, sample in every.items():
        (directory / f"{name}.json").write_text(json.dumps(sample, indent=1, sort_keys=True) + "\n")
    return sorted(every)


def _value(data: bytes) -> dict[str, object]:
    return {"data": _b64(data)}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


if __name__ == "__main__":
    print("\n".join(write(Path(sys.argv[1]) if len(sys.argv) > 1 else DIR)))
