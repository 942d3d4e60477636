"""A NATS bus nobody trusts by default (issue 22): routed requests are signed with the
cluster's key, so a plain client of the bus cannot act as an instance; NATS credentials and
TLS to NATS; and an instance without a key (nor an explicit trust) does not join.

Real nats-server processes (with token, user/password and TLS configurations), real
instances, and a plain nats-py client playing the intruder.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import nats
import pytest
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.tasks import TaskUpdater
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    TaskState,
)
from nats.aio.client import Client
from nats.aio.msg import Msg

from a2a_grpc_server import ServerConfig
from a2a_grpc_server._internal.jetstream.formats import CURRENT
from a2a_grpc_server._internal.jetstream.formats import HEADER as FORMAT
from a2a_grpc_server._internal.jetstream.routing import (
    CALL_HEADERS,
    CALLER,
    TIMEOUT,
    control_subject,
)
from a2a_grpc_server._internal.jetstream.signing import SIGNATURE
from a2a_grpc_server.testing._nats import running
from tests.support import cluster_key_file
from tests.support.agents import Hanging, InputAgent
from tests.support.certs import issue
from tests.support.clusterharness import instances
from tests.support.harness import V1, rich_status, send_request
from tests.support.serveproc import refusal, start

S = TaskState
AGENT = ("--agent", "tests.support.agents:InputAgent")


def forged_headers(principal: str = "") -> dict[str, str]:
    """What an instance's routed request carries, less its signature."""
    return {
        CALL_HEADERS: "[]",
        CALLER: json.dumps([principal or None, ""]),
        TIMEOUT: "5",
        FORMAT: str(CURRENT),
    }


async def unanswered(client: Client, subject: str, payload: bytes, headers: dict[str, str]) -> bool:
    """Whether a request goes unanswered (an owner does not answer what it refuses)."""
    try:
        await client.request(subject, payload, timeout=1.0, headers=headers)
    except nats.errors.TimeoutError:
        return True
    return False


async def test_a_plain_client_of_the_bus_cannot_cancel_a_task_or_replay_a_request(
    nats_url: str,
) -> None:
    async with asyncio.timeout(60), instances(InputAgent(), [nats_url]) as (a, b):
        task = (await a.stub.SendMessage(send_request("hi"), metadata=V1)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        owner = a.cluster.instance_id
        intruder = await nats.connect(nats_url)
        try:
            subject = control_subject(owner, "cancel")
            # Unsigned, as any client of the bus could send it; then signed with a key of
            # its own. Neither is served, nor answered (no signed answer to reuse).
            assert await unanswered(intruder, subject, task.id.encode(), forged_headers())
            headers = forged_headers() | {SIGNATURE: "1:0:nonce:" + "0" * 64}
            assert await unanswered(intruder, subject, task.id.encode(), headers)
            headers = forged_headers() | {SIGNATURE: "1:0:nonce:\u00e9"}  # (not hex, not ASCII)
            assert await unanswered(intruder, subject, task.id.encode(), headers)
            seen = await a.stub.GetTask(GetTaskRequest(id=task.id), metadata=V1)
            assert seen.status.state == S.TASK_STATE_INPUT_REQUIRED, "nothing was done"
            # A real routed cancel (B asks A), overheard on the bus, then replayed.
            overheard: asyncio.Future[Msg] = asyncio.Future()

            async def overhear(msg: Msg) -> None:
                if not overheard.done():
                    overheard.set_result(msg)

            await intruder.subscribe(subject, cb=overhear)
            await intruder.flush()
            canceled = await b.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=V1)
            assert canceled.status.state == S.TASK_STATE_CANCELED, "signed: served"
            real = await overheard
            assert real.headers is not None and SIGNATURE in real.headers
            assert await unanswered(intruder, subject, real.data, dict(real.headers))
        finally:
            await intruder.close()


async def test_a_forged_answer_in_the_askers_inbox_changes_nothing(nats_url: str) -> None:
    # The owner takes a while to answer (its agent ignores cancel: cancel_timeout); an
    # intruder who overheard the request floods its inbox meanwhile.
    async with asyncio.timeout(60), instances(Hanging(), [nats_url]) as (a, b):
        stream = a.stub.SendStreamingMessage(send_request("hi"), metadata=V1)
        first = await stream.read()
        task_id = first.task.id
        intruder = await nats.connect(nats_url)
        try:

            async def forge(msg: Msg) -> None:
                for forged in ({"A2a-Error": "InternalError"}, {}, {"Status": "503"}):
                    await intruder.publish(msg.reply, b"forged", headers=forged)

            await intruder.subscribe(control_subject(a.cluster.instance_id, "cancel"), cb=forge)
            await intruder.flush()
            canceled = await b.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
            assert canceled.status.state == S.TASK_STATE_CANCELED, "the owner's own answer"
        finally:
            await intruder.close()
        while await stream.read() is not grpc.aio.EOF:  # (up to its final frame)
            pass


def test_an_instance_without_a_cluster_key_does_not_join(tmp_path: Path) -> None:
    said = refusal("--nats", "nats://127.0.0.1:4222")
    assert "nats_key_file" in said and "nats_trust_bus" in said, said
    short = tmp_path / "short.key"
    short.write_text("too short\n")
    said = refusal("--nats", "nats://127.0.0.1:4222", "--nats-key-file", str(short))
    assert "at least 32" in said, said
    said = refusal("--nats", "nats://127.0.0.1:4222", "--nats-key-file", str(tmp_path / "nope"))
    assert "cannot be read" in said, said


async def test_nats_credentials_are_given_and_a_refusal_says_so(tmp_path: Path) -> None:
    token = tmp_path / "nats.token"
    token.write_text("s3cret-nats-token\n")
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-it\n")
    with running(conf='authorization { token: "s3cret-nats-token" }') as cluster:
        url = cluster.urls[0]
        said = refusal(*AGENT, "--nats", url, "--nats-key-file", str(cluster_key_file()))
        assert "refused this instance's credentials" in said, said
        said = refusal(
            *AGENT, "--nats", url, "--nats-key-file", str(cluster_key_file()),
            "--nats-token-file", str(wrong),
        )  # fmt: skip
        assert "refused this instance's credentials" in said, said
        server = await start(*AGENT, "--nats", url, "--nats-token-file", str(token))
        try:
            assert server.proc.returncode is None, "joined with the token"
        finally:
            server.proc.kill()
            await server.proc.wait()


async def test_tls_to_nats_with_the_ca_given(tmp_path: Path) -> None:
    issued = issue(tmp_path, dns=("localhost",), ips=("127.0.0.1",))
    tls = f'tls {{ cert_file: "{issued.cert}", key_file: "{issued.key}" }}'
    with running(conf=tls) as cluster:
        url = cluster.urls[0].replace("nats://", "tls://")
        said = refusal(*AGENT, "--nats", url, "--nats-key-file", str(cluster_key_file()))
        assert "cannot connect to NATS" in said, "the server's certificate is not trusted"
        server = await start(*AGENT, "--nats", url, "--nats-tls-ca", str(issued.ca))
        try:
            assert server.proc.returncode is None, "joined over TLS"
        finally:
            server.proc.kill()
            await server.proc.wait()


def test_credentials_that_need_nkeys_say_so(tmp_path: Path) -> None:
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    said = refusal(
        *AGENT, "--nats", "nats://127.0.0.1:1", "--nats-key-file", str(cluster_key_file()),
        "--nats-creds-file", str(creds),
    )  # fmt: skip
    try:
        import nkeys  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        assert "need the nkeys package" in said, said
    else:
        assert "cannot connect to NATS" in said, said


class SlowCancel(AgentExecutor):
    """Works until canceled; its ``cancel()`` waits until the test releases the task."""

    def __init__(self) -> None:
        self.working: dict[str, asyncio.Event] = {}
        self.canceling: dict[str, asyncio.Event] = {}
        self._release: dict[str, asyncio.Event] = {}

    def release(self, task_id: str) -> None:
        self._release.setdefault(task_id, asyncio.Event()).set()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).start_work()
        self.working.setdefault(context.task_id, asyncio.Event()).set()
        await asyncio.Event().wait()  # (until canceled)

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        self.canceling.setdefault(context.task_id, asyncio.Event()).set()
        await self._release.setdefault(context.task_id, asyncio.Event()).wait()
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


async def test_routed_requests_past_the_instances_bound_are_refused_at_once(
    nats_url: str,
) -> None:
    # Every routed request got an asyncio task of its own, however many were in flight
    # (issue 22). Past routed_in_flight a cancel or follow-up is refused at once,
    # UNAVAILABLE OWNER_UNAVAILABLE, having done nothing; a retry once there is room works.
    agent = SlowCancel()
    config = ServerConfig(cancel_timeout=30.0)
    async with (
        asyncio.timeout(60),
        instances(agent, [nats_url], config=config, routed_in_flight=2) as (a, b),
    ):
        ids = []
        for text in ("1", "2", "3"):
            answer = await a.stub.SendMessage(send_request(text, immediately=True), metadata=V1)
            ids.append(answer.task.id)
        for task_id in ids:  # each WORKING at A
            await agent.working.setdefault(task_id, asyncio.Event()).wait()
        held = [b.stub.CancelTask(CancelTaskRequest(id=i), metadata=V1) for i in ids[:2]]
        for task_id in ids[:2]:  # both routed cancels are being served at A
            await agent.canceling.setdefault(task_id, asyncio.Event()).wait()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async with asyncio.timeout(5):  # at once, not after the others
                await b.stub.CancelTask(CancelTaskRequest(id=ids[2]), metadata=V1)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert rich_status(caught.value)[1].reason == "OWNER_UNAVAILABLE"
        assert "routed_in_flight" in (caught.value.details() or "")
        assert ids[2] not in agent.canceling, "nothing was done"
        seen = await a.stub.GetTask(GetTaskRequest(id=ids[2]), metadata=V1)
        assert seen.status.state == S.TASK_STATE_WORKING
        for task_id in ids:
            agent.release(task_id)
        for call in held:
            assert (await call).status.state == S.TASK_STATE_CANCELED
        retried = await b.stub.CancelTask(CancelTaskRequest(id=ids[2]), metadata=V1)
        assert retried.status.state == S.TASK_STATE_CANCELED
