"""Push notifications against a real HTTP receiver on 127.0.0.1: the config RPCs, what a
webhook receives (every frame after registration, in order, the final one last, whatever
ended the task), retries, a receiver that never answers, and refused targets."""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AuthenticationInfo,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)

from a2a_grpc_server import A2AService, ServerConfig
from a2a_grpc_server._internal.push.configs import MemoryPushConfigs
from a2a_grpc_server._internal.push.screen import RefusedTargetError, Screen, refused_address
from a2a_grpc_server._internal.push.sender import Outcome, WebhookSender, retry_after
from a2a_grpc_server._internal.push.service import PushService
from tests.support.agents import (
    BurstAgent,
    CancelMode,
    EndingAgent,
    GatedAgent,
    InputAgent,
    MessageAgent,
)
from tests.support.certs import issue
from tests.support.harness import (
    ALICE,
    BOB,
    V1,
    expose,
    read_all,
    rich_status,
    send_request,
    serve,
    tokens,
)
from tests.support.webhook import (
    Answer,
    Post,
    assert_complete,
    bare_http,
    receiving,
    with_webhook,
)

S = TaskState
PRIVATE = ServerConfig(cancel_timeout=1.0, push_allow_private=True)
"""The receiver listens on 127.0.0.1: these servers may reach it."""


async def grpc_code(call: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and ErrorInfo reason of a call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), rich_status(caught.value)[1].reason


async def test_config_rpcs_create_get_list_delete() -> None:
    agent = InputAgent()
    # Nothing listens on port 9: each frame is given up at once instead of retried.
    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_retry_for=0)
    async with asyncio.timeout(20), serve(agent, config) as h:
        assert h.service.card.capabilities.push_notifications
        task = (await h.stub.SendMessage(send_request("hi"), metadata=V1)).task
        assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
        made = await h.stub.CreateTaskPushNotificationConfig(
            TaskPushNotificationConfig(
                task_id=task.id,
                url="http://127.0.0.1:9/a",
                token="tok",
                authentication=AuthenticationInfo(scheme="Bearer", credentials="c"),
            ),
            metadata=V1,
        )
        assert made.id and made.task_id == task.id  # a server-assigned id
        got = await h.stub.GetTaskPushNotificationConfig(
            GetTaskPushNotificationConfigRequest(task_id=task.id, id=made.id), metadata=V1
        )
        assert made.token == "tok" and made.authentication.credentials == "c"
        secretless = TaskPushNotificationConfig()
        secretless.CopyFrom(made)
        secretless.ClearField("token")
        secretless.authentication.ClearField("credentials")
        assert got == secretless, "Get leaves the secrets out (the scheme stays)"
        assert got.authentication.scheme == "Bearer"
        for name in ("b", "c"):
            await h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task.id, id=name, url="http://127.0.0.1:9/"),
                metadata=V1,
            )
        first = await h.stub.ListTaskPushNotificationConfigs(
            ListTaskPushNotificationConfigsRequest(task_id=task.id, page_size=2), metadata=V1
        )
        assert [c.id for c in first.configs] == [made.id, "b"] and first.next_page_token
        assert first.configs[0] == secretless, "so does List"
        rest = await h.stub.ListTaskPushNotificationConfigs(
            ListTaskPushNotificationConfigsRequest(
                task_id=task.id, page_size=2, page_token=first.next_page_token
            ),
            metadata=V1,
        )
        assert [c.id for c in rest.configs] == ["c"] and not rest.next_page_token
        for _ in range(2):  # idempotent
            await h.stub.DeleteTaskPushNotificationConfig(
                DeleteTaskPushNotificationConfigRequest(task_id=task.id, id="b"), metadata=V1
            )
        assert await grpc_code(
            h.stub.GetTaskPushNotificationConfig(
                GetTaskPushNotificationConfigRequest(task_id=task.id, id="b"), metadata=V1
            )
        ) == (grpc.StatusCode.NOT_FOUND, "PUSH_CONFIG_NOT_FOUND")
        for call in (
            h.stub.GetTaskPushNotificationConfig(
                GetTaskPushNotificationConfigRequest(task_id="nope", id="b"), metadata=V1
            ),
            h.stub.DeleteTaskPushNotificationConfig(
                DeleteTaskPushNotificationConfigRequest(task_id="nope", id="b"), metadata=V1
            ),
            h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id="nope", url="http://127.0.0.1:9/"), metadata=V1
            ),
        ):
            assert await grpc_code(call) == (grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")
        for i in range(PRIVATE.push_max_configs - 2):
            await h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task.id, id=f"n{i}", url="http://127.0.0.1:9/"),
                metadata=V1,
            )
        assert await grpc_code(
            h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task.id, url="http://127.0.0.1:9/"), metadata=V1
            )
        ) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "PUSH_CONFIG_LIMIT")
        await h.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=V1)
        await h.settle(within=10)


REFUSED_URLS = [
    ("http://example.com/hook", "not an https URL"),
    ("https://127.0.0.1/hook", "loopback"),
    ("https://169.254.169.254/latest/meta-data", "link-local"),
    ("https://10.0.0.1/hook", "not a public address"),
    ("https://[::ffff:127.0.0.1]/hook", "loopback"),
    ("https://user:pw@example.com/hook", "user info"),
    ("https://" + "a" * 2050 + ".com/", "at most 2048"),
    ("ftp://example.com/", "not an https URL"),
    ("https://bücher.example/", "non-ASCII"),
    ("https://" + "a" * 64 + ".example/", "malformed host"),
    ("https://example.com/a\x00b", "control character"),
    # Numeric IPv4 forms every resolver and HTTP client reads as 127.0.0.1 (issue 22).
    ("https://2130706433/hook", "loopback"),
    ("https://0x7f.1/hook", "loopback"),
    ("https://127.1/hook", "loopback"),
    ("https://0177.0.0.1/hook", "loopback"),
    ("https://0x0a000001/hook", "not a public address"),
    ("https://999.1/hook", "numeric host that is no address"),
    ("https://example.com:0/hook", "port 0"),
]


async def test_refused_webhook_urls_answer_invalid_argument_naming_the_field() -> None:
    async with asyncio.timeout(20), serve(InputAgent()) as h:
        task = (await h.stub.SendMessage(send_request("hi"), metadata=V1)).task
        for url, why in REFUSED_URLS:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await h.stub.CreateTaskPushNotificationConfig(
                    TaskPushNotificationConfig(task_id=task.id, url=url), metadata=V1
                )
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, url
            assert why in (caught.value.details() or ""), (url, caught.value.details())
        bad_token = TaskPushNotificationConfig(
            task_id=task.id, url="https://example.com/", token="a\r\nX-Evil: 1"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.CreateTaskPushNotificationConfig(bad_token, metadata=V1)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "token" in (caught.value.details() or "")
        forged_id = TaskPushNotificationConfig(
            task_id=task.id, id="c1\nINFO forged log line", url="https://example.com/"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.CreateTaskPushNotificationConfig(forged_id, metadata=V1)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "control character" in (caught.value.details() or "")
        inline = with_webhook(send_request("x"), "https://10.1.2.3/")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await h.stub.SendMessage(inline, metadata=V1)
        assert "configuration.task_push_notification_config.url" in (caught.value.details() or "")
        assert h.service.engine.tasks.count == 1  # the refused message started nothing
        await h.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=V1)
        await h.settle(within=5)


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("93.184.216.34", False),
        ("2606:4700::1111", False),
        ("127.0.0.1", True),
        ("169.254.169.254", True),
        ("10.0.0.1", True),
        ("100.64.0.1", True),  # carrier-grade NAT
        ("0.0.0.0", True),
        ("224.0.0.1", True),
        ("::1", True),
        ("fe80::1", True),
        ("fd00:ec2::254", True),  # a cloud metadata endpoint over IPv6
        ("::ffff:10.0.0.1", True),
        ("64:ff9b::a00:1", True),  # NAT64 of 10.0.0.1
        ("2002:a00:1::", True),  # 6to4 of 10.0.0.1
        ("::7f00:1", True),  # IPv4-compatible 127.0.0.1
        ("::ffff:0:7f00:1", True),  # SIIT
        ("64:ff9b:1::7f00:1", True),  # local-use NAT64
        ("fec0::1", True),  # site-local
        ("4000::1", True),  # unassigned
        ("3fff::1", True),  # documentation (RFC 9637)
    ],
)
def test_which_addresses_push_may_reach(address: str, refused: bool) -> None:
    assert (refused_address(ipaddress.ip_address(address)) is not None) is refused


async def test_the_address_is_checked_when_connecting_not_only_at_creation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DNS cannot be served here for a made-up name: this one test replaces the resolver.
    loop = asyncio.get_running_loop()

    async def resolve(host: str, port: int, **_: Any) -> list[Any]:
        address = {"rebinding.example": "10.0.0.1", "public.example": "93.184.216.34"}[host]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(loop, "getaddrinfo", resolve)
    screen = Screen()
    screen.url("https://rebinding.example/hook")  # a name passes at creation...
    with pytest.raises(RefusedTargetError, match=r"10\.0\.0\.1"):
        await screen.resolve("https://rebinding.example/hook")  # ...not when connecting
    target = await screen.resolve("https://public.example:8443/h?q=1")
    assert target.url == "https://93.184.216.34:8443/h?q=1"
    assert (target.host, target.server_name) == ("public.example:8443", "public.example")
    assert (await Screen(allow_hosts=("*.example",)).resolve("https://rebinding.example/")).url


async def test_a_name_resolving_to_loopback_is_never_posted_to() -> None:
    with receiving() as receiver:
        async with asyncio.timeout(20), serve(GatedAgent()) as h:
            agent = h.service.engine.runs.executor
            assert isinstance(agent, GatedAgent)
            agent.release.set()
            request = with_webhook(send_request("go"), f"https://localhost:{receiver.port}/")
            task = (await h.stub.SendMessage(request, metadata=V1)).task
            assert task.status.state == S.TASK_STATE_COMPLETED
            await h.settle(within=10)
            assert h.service.metrics.push_deliveries["given_up"] >= 1
            assert not receiver.attempts


async def test_a_webhook_gets_every_frame_in_order_with_its_headers() -> None:
    agent = GatedAgent()
    with receiving() as receiver:
        async with asyncio.timeout(20), serve(agent, PRIVATE) as h:
            request = with_webhook(send_request("go"), receiver.url(), token="secret-1")
            request.configuration.task_push_notification_config.authentication.CopyFrom(
                AuthenticationInfo(scheme="Bearer", credentials="cred-1")
            )
            frames: list[Any] = []
            stream = h.stub.SendStreamingMessage(request, metadata=V1)
            agent.release.set()
            await read_all(stream, frames)
            task_id = frames[0].task.id
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            posts = receiver.frames(task_id)
            assert_complete(posts, S.TASK_STATE_COMPLETED)
            assert [p.frame.WhichOneof("payload") for p in posts] == [
                f.WhichOneof("payload") for f in frames
            ], "the webhook gets what the stream got"
            headers = posts[0].headers
            assert headers["content-type"] == "application/a2a+json"
            assert headers["a2a-version"] == "1.0"
            assert headers["x-a2a-notification-token"] == "secret-1"
            assert headers["authorization"] == "Bearer cred-1"
            assert headers["host"] == f"127.0.0.1:{receiver.port}"
            await h.settle(within=5)  # (the delivery counts a frame once the answer is back)
            assert h.service.metrics.push_deliveries["delivered"] == len(posts)


async def ended_by(how: str, agent: Any, h: Any, task_id: str) -> TaskState:
    """End the task ``how``; return the final state the webhook must get."""
    if how.startswith("cancel-"):
        await h.stub.CancelTask(CancelTaskRequest(id=task_id), metadata=V1)
        return S.TASK_STATE_CANCELED
    if how == "shutdown":
        await h.service.shutdown(grace=0)
        return S.TASK_STATE_FAILED
    agent.release.set()
    return S.TASK_STATE_FAILED


ENDINGS = ["cancel-cooperative", "cancel-noop", "cancel-raises", "cancel-hangs"]
ENDINGS += ["crash", "no-outcome", "shutdown"]


@pytest.mark.parametrize("how", ENDINGS)
async def test_the_webhook_gets_the_final_state_however_the_task_ends(how: str) -> None:
    agent: GatedAgent | EndingAgent
    if how.startswith("cancel-"):
        mode: CancelMode = how.removeprefix("cancel-")  # type: ignore[assignment]
        agent = GatedAgent(mode)
    else:
        agent = EndingAgent(crash=how == "crash") if how != "shutdown" else GatedAgent()
    with receiving() as receiver:
        async with asyncio.timeout(30), serve(agent, PRIVATE) as h:
            request = with_webhook(send_request("go", immediately=True), receiver.url())
            task_id = (await h.stub.SendMessage(request, metadata=V1)).task.id
            await agent.working.wait()
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_WORKING for p in receiver.frames(task_id))
            )
            final = await ended_by(how, agent, h, task_id)
            await receiver.wait_for(
                lambda: any(p.state == final for p in receiver.frames(task_id)), within=15
            )
            assert_complete(receiver.frames(task_id), final)
            if how != "shutdown":
                await h.settle(within=10)


async def delivered_after(answer: Callable[[Post, int], Answer]) -> tuple[list[Post], int]:
    """A task's frames sent to a receiver answering ``answer``: its attempts, and the retries."""
    agent = GatedAgent()
    agent.release.set()
    with receiving(answer) as receiver:
        async with asyncio.timeout(30), serve(agent, PRIVATE) as h:
            request = with_webhook(send_request("go"), receiver.url())
            task_id = (await h.stub.SendMessage(request, metadata=V1)).task.id
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            assert_complete(receiver.frames(task_id), S.TASK_STATE_COMPLETED)
            retries = h.service.metrics.push_retries
            await h.settle(within=10)
            return receiver.attempts, retries


async def test_retries_until_the_receiver_takes_it_honouring_retry_after() -> None:
    def flaky(post: Post, attempt: int) -> Answer:
        if attempt < 2:
            return Answer(503)
        if attempt == 2:
            return Answer(429, {"Retry-After": "1"})
        return Answer(204)

    first, retries = await delivered_after(flaky)
    assert [p.seq for p in first[:4]] == [1, 1, 1, 1], "frame 1 retried, nothing skipped"
    assert first[3].at - first[2].at >= 0.9, "Retry-After: 1 was honoured"
    assert retries == 3


async def test_a_retry_after_of_zero_does_not_make_a_retry_loop() -> None:
    # A receiver (chosen by the client) answering "503, Retry-After: 0" once made the
    # delivery re-POST flat out, a core's worth, for push_retry_for (600 s).
    def busy(post: Post, attempt: int) -> Answer:
        return Answer(503, {"Retry-After": "0"}) if attempt < 2 else Answer(204)

    first, retries = await delivered_after(busy)
    assert [p.seq for p in first[:3]] == [1, 1, 1]
    # The backoff's first pause is 0.5 s with jitter (0.25 s at least), then 1 s.
    gaps = [b.at - a.at for a, b in itertools.pairwise(first[:3])]
    assert min(gaps) >= 0.2, f"Retry-After: 0 shortened the backoff: {gaps}"
    assert retries == 2


async def test_a_receiver_that_never_answers_does_not_hold_up_the_task_or_its_streams() -> None:
    agent = GatedAgent()
    with receiving(lambda post, attempt: Answer(hold=True)) as receiver:
        async with asyncio.timeout(30), serve(agent, PRIVATE) as h:
            request = with_webhook(send_request("go"), receiver.url())
            stream = h.stub.SendStreamingMessage(request, metadata=V1)
            first = await stream.read()
            await receiver.wait_for(lambda: len(receiver.attempts) == 1)  # held open
            agent.release.set()
            frames = [first]
            await read_all(stream, frames)  # the stream ends while the webhook still holds
            assert frames[-1].status_update.status.state == S.TASK_STATE_COMPLETED
            assert len(receiver.attempts) == 1 and not receiver.posts
            assert h.service.metrics.push_in_flight == 1
            push = h.service.push
            assert push is not None and push.dispatcher.count == 1
            receiver.release.set()  # now it answers: the rest follows, in order
            task_id = first.task.id
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            await h.settle(within=10)


async def test_webhooks_that_hang_hold_up_their_own_callers_pushes_not_anothers(
    tmp_path: Path,
) -> None:
    # Each request to a webhook that hangs holds an instance slot up to push_timeout: one
    # caller with as many such webhooks as the instance has slots once stalled everyone's.
    config = ServerConfig(
        push_allow_private=True, push_max_in_flight=4, quota_push_in_flight=2, push_timeout=30
    )
    agent = GatedAgent()
    agent.release.set()
    with (
        receiving(lambda post, attempt: Answer(hold=True)) as hanging,
        receiving() as live,
    ):
        async with asyncio.timeout(30), serve(agent, config, auth=tokens(tmp_path)) as h:
            for _ in range(4):  # as many tasks as the instance has slots
                request = with_webhook(send_request("go"), hanging.url())
                await h.stub.SendMessage(request, metadata=ALICE)
            await hanging.wait_for(lambda: len(hanging.attempts) == 2)  # her two slots, held
            request = with_webhook(send_request("go"), live.url())
            task_id = (await h.stub.SendMessage(request, metadata=BOB)).task.id
            await live.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in live.frames(task_id)),
                within=10,
            )
            assert_complete(live.frames(task_id), S.TASK_STATE_COMPLETED)
            assert len(hanging.attempts) == 2, "her other deliveries wait for her own slots"
            hanging.release.set()  # now it answers: her tasks' frames follow
            await hanging.wait_for(lambda: len(hanging.posts) >= 4 * 3)
            push = h.service.push
            assert push is not None
            await h.settle(within=10)
            assert not push.dispatcher._callers, "nothing kept per principal once deliveries end"


async def test_the_one_anonymous_caller_is_not_held_to_the_push_quota() -> None:
    # Every caller is the anonymous principal then: a bound of its own would only leave
    # the instance's other slots unused (as for the other quotas, it is the whole instance).
    config = ServerConfig(
        push_allow_private=True, push_max_in_flight=4, quota_push_in_flight=2, push_timeout=30
    )
    agent = GatedAgent()
    agent.release.set()
    with receiving(lambda post, attempt: Answer(hold=True)) as hanging:
        async with asyncio.timeout(30), serve(agent, config) as h:
            for _ in range(4):
                request = with_webhook(send_request("go"), hanging.url())
                await h.stub.SendMessage(request, metadata=V1)
            await hanging.wait_for(lambda: len(hanging.attempts) == 4)  # all the slots
            hanging.release.set()
            await hanging.wait_for(lambda: len(hanging.posts) >= 4 * 3)
            await h.settle(within=10)


async def test_a_config_created_on_a_waiting_task_gets_what_follows() -> None:
    with receiving() as receiver:
        async with asyncio.timeout(20), serve(InputAgent(), PRIVATE) as h:
            task = (await h.stub.SendMessage(send_request("hi"), metadata=V1)).task
            await h.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task.id, url=receiver.url()), metadata=V1
            )
            answer = await h.stub.SendMessage(
                send_request("bob", task_id=task.id, context_id=task.context_id), metadata=V1
            )
            assert answer.task.status.state == S.TASK_STATE_COMPLETED
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task.id))
            )
            posts = receiver.frames(task.id)
            assert posts[0].seq > 1, "frames before the config was registered are not sent"
            assert_complete(posts, S.TASK_STATE_COMPLETED, first_seq=posts[0].seq)
            await h.settle(within=10)


async def test_with_push_off_an_inline_config_is_refused_not_ignored() -> None:
    config = ServerConfig(cancel_timeout=1.0, push=False)
    async with asyncio.timeout(10), serve(GatedAgent(), config) as h:
        request = with_webhook(send_request("go"), "https://example.com/hook")
        code, reason = await grpc_code(h.stub.SendMessage(request, metadata=V1))
        assert (code, reason) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "PUSH_NOTIFICATION_NOT_SUPPORTED",
        )
        assert h.service.engine.tasks.count == 0


async def test_a_card_without_streaming_refuses_the_streaming_rpcs() -> None:
    card = AgentCard(name="unary", capabilities=AgentCapabilities(streaming=False))
    service = A2AService(GatedAgent(), card, config=ServerConfig(cancel_timeout=1.0))
    h = await expose(service)
    try:
        async with asyncio.timeout(10):
            for call in (
                h.stub.SendStreamingMessage(send_request("go"), metadata=V1),
                h.stub.SubscribeToTask(SubscribeToTaskRequest(id="t"), metadata=V1),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await read_all(call, [])
                assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert rich_status(caught.value)[1].reason == "UNSUPPORTED_OPERATION"
            assert service.engine.tasks.count == 0
    finally:
        await service.shutdown(grace=0)
        await h.client.close()
        await h.channel.close()
        await h.server.stop(grace=None)


async def test_a_parked_task_with_a_webhook_leaves_memory_and_its_webhook_goes_on() -> None:
    with receiving() as receiver:
        async with asyncio.timeout(20), serve(InputAgent(), PRIVATE) as h:
            engine = h.service.engine
            request = with_webhook(send_request("hi"), receiver.url())
            task = (await h.stub.SendMessage(request, metadata=V1)).task
            parked = S.TASK_STATE_INPUT_REQUIRED
            await receiver.wait_for(lambda: any(p.state == parked for p in receiver.posts))
            horizon = engine.tasks.pool.clock() + h.service.config.parked_timeout
            assert engine.tasks.parking.evict_idle(now=horizon) == 1, (
                "a webhook keeps no task in memory"
            )
            assert engine.tasks.count == 0
            push = h.service.push
            assert push is not None and not push.dispatcher.following(task.id)
            answer = await h.stub.SendMessage(
                send_request("bob", task_id=task.id, context_id=task.context_id), metadata=V1
            )
            assert answer.task.status.state == S.TASK_STATE_COMPLETED
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task.id))
            )
            assert_complete(receiver.frames(task.id), S.TASK_STATE_COMPLETED)
            await h.settle(within=5)


async def test_configs_go_when_the_journal_drops_their_task() -> None:
    config = ServerConfig(cancel_timeout=1.0, max_final_tasks=1, push_retry_for=0)
    async with asyncio.timeout(20), serve(InputAgent(), config) as h:
        push = h.service.push
        assert push is not None
        first = (await h.stub.SendMessage(send_request("a"), metadata=V1)).task
        await h.stub.CreateTaskPushNotificationConfig(
            TaskPushNotificationConfig(task_id=first.id, id="k", url="https://example.invalid/"),
            metadata=V1,
        )
        await h.stub.CancelTask(CancelTaskRequest(id=first.id), metadata=V1)
        second = (await h.stub.SendMessage(send_request("b"), metadata=V1)).task
        await h.stub.CancelTask(CancelTaskRequest(id=second.id), metadata=V1)  # first dropped
        assert await grpc_code(
            h.stub.GetTaskPushNotificationConfig(
                GetTaskPushNotificationConfigRequest(task_id=first.id, id="k"), metadata=V1
            )
        ) == (grpc.StatusCode.NOT_FOUND, "TASK_NOT_FOUND")
        await h.settle(within=10)  # (once its delivery has ended)
        assert await push.store.get(first.id, "k") is None


async def test_https_delivery_verifies_the_webhooks_name_on_the_checked_address(
    tmp_path: Path,
) -> None:
    issued = issue(tmp_path, dns=("localhost",))  # no IP in the certificate: only the name
    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_ca_file=str(issued.ca))
    agent = GatedAgent()
    agent.release.set()
    with receiving(tls=(issued.cert, issued.key)) as receiver:
        async with asyncio.timeout(20), serve(agent, config) as h:
            # Resolved to 127.0.0.1 and connected there; TLS still checks "localhost".
            url = f"https://localhost:{receiver.port}/hook"
            task_id = (
                await h.stub.SendMessage(with_webhook(send_request("go"), url), metadata=V1)
            ).task.id
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            assert_complete(receiver.frames(task_id), S.TASK_STATE_COMPLETED)
            assert receiver.posts[0].headers["host"] == f"localhost:{receiver.port}"
            await h.settle(within=5)
        # A server that does not trust that CA posts nothing.
        untrusting = ServerConfig(cancel_timeout=1.0, push_allow_private=True, push_retry_for=0)
        async with asyncio.timeout(20), serve(agent, untrusting) as h:
            before = len(receiver.attempts)
            await h.stub.SendMessage(with_webhook(send_request("go"), url), metadata=V1)
            await h.settle(within=5)
            assert h.service.metrics.push_deliveries["given_up"] >= 1
            assert len(receiver.attempts) == before


async def test_a_stuck_webhook_keeps_no_more_than_the_log_keeps_then_gets_the_outcome() -> None:
    burst, kept = 500, 64
    agent = BurstAgent(burst, 1000)
    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, log_max_frames=kept)
    with receiving(lambda post, attempt: Answer(hold=attempt == 0)) as receiver:
        async with asyncio.timeout(30), serve(agent, config) as h:
            request = with_webhook(send_request("go", immediately=True), receiver.url())
            task_id = (await h.stub.SendMessage(request, metadata=V1)).task.id
            await receiver.wait_for(lambda: len(receiver.attempts) == 1)  # frame 1, held
            agent.release.set()
            engine = h.service.engine
            live = engine.tasks.live_task(task_id)
            assert live is not None
            while not live.log.closed:
                await live.log.wait_changed()
            # The burst is over; the stuck webhook holds at most what the log keeps.
            assert live.log.kept <= kept
            assert live.log.last_seq > burst
            receiver.release.set()
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            posts = receiver.frames(task_id)
            assert posts[-1].frame.WhichOneof("payload") == "task", "it jumped to the task"
            assert posts[-1].seq == live.log.last_seq
            assert len(posts[-1].frame.task.artifacts) == burst, "the outcome, all of it"
            await h.settle(within=10)
            assert h.service.metrics.push_frames_skipped == 1


async def test_allowed_hosts_given_as_a_list_still_screen_every_delivery() -> None:
    # A list made the screen unhashable: every delivery's cached check raised TypeError.
    screen = Screen(allow_hosts=["hooks.example.com"])  # type: ignore[arg-type]
    target = await screen.resolve("https://93.184.216.34/hook")  # (an IP: nothing resolved)
    assert target.url == "https://93.184.216.34:443/hook"
    with pytest.raises(RefusedTargetError):
        await screen.resolve("https://127.0.0.1/hook")


def test_an_unreadable_retry_after_is_ignored() -> None:
    assert retry_after("²") is None and retry_after("soon") is None
    assert retry_after("7") == 7.0


async def test_push_timeout_bounds_the_whole_attempt_even_against_a_trickling_receiver() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        for byte in b"HTTP/1.1 200 OK\r\n":  # one byte at a time: no read ever times out
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.2)  # sync-ok: the receiver is slow on purpose

    sender = WebhookSender(Screen(allow_private=True), timeout=0.5, max_connections=1)
    try:
        async with bare_http(trickle) as port, asyncio.timeout(10):
            config = TaskPushNotificationConfig(id="c", url=f"http://127.0.0.1:{port}/")
            attempt = await sender.post(config, "t", 1, b"{}")
        assert attempt.outcome is Outcome.RETRY
        assert "no answer within 0.5 s" in attempt.detail
    finally:
        await sender.close()


async def test_the_sender_reuses_connections_reads_at_most_64_kib_follows_no_redirect() -> None:
    connections = 0
    requests: list[bytes] = []
    agents: list[bytes] = []
    big = 1024 * 1024

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            path = head.split(b" ", 2)[1]
            requests.append(path)
            agents.extend(h for h in head.lower().split(b"\r\n") if h.startswith(b"user-agent:"))
            if path == b"/big":  # a body far past what the sender reads
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % big)
                writer.write(b"x" * big)
            elif path == b"/moved":
                writer.write(b"HTTP/1.1 302 Found\r\nLocation: /ok\r\nContent-Length: 0\r\n\r\n")
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()

    sender = WebhookSender(Screen(allow_private=True), timeout=5, max_connections=4)
    try:
        async with bare_http(answer) as port, asyncio.timeout(20):

            def config(path: str) -> TaskPushNotificationConfig:
                return TaskPushNotificationConfig(id="c", url=f"http://127.0.0.1:{port}{path}")

            for seq in range(5):  # one after another: one connection, kept
                attempt = await sender.post(config("/ok"), "t", seq, b"{}")
                assert attempt.outcome is Outcome.DELIVERED, attempt
            assert connections == 1
            attempt = await sender.post(config("/big"), "t", 5, b"{}")
            assert attempt.outcome is Outcome.DELIVERED, attempt
            assert (await sender.post(config("/ok"), "t", 6, b"{}")).outcome is Outcome.DELIVERED
            assert connections == 2, "the connection with an unread answer was not reused"
            attempt = await sender.post(config("/moved"), "t", 7, b"{}")
            assert (attempt.outcome, attempt.detail) == (Outcome.REFUSED, "HTTP 302")
            assert requests == [b"/ok"] * 5 + [b"/big", b"/ok", b"/moved"]  # not followed
            assert len(agents) == len(requests)  # (some firewalls refuse a request without one)
            assert all(agent.startswith(b"user-agent: a2a-grpc-server/") for agent in agents)
    finally:
        await sender.close()


async def test_the_final_frame_is_still_delivered_after_the_journal_dropped_the_task() -> None:
    def recovering(post: Post, attempt: int) -> Answer:
        return Answer(503) if attempt < 2 else Answer(204)

    agent = GatedAgent()
    agent.release.set()
    config = ServerConfig(cancel_timeout=1.0, push_allow_private=True, max_final_tasks=1)
    with receiving(recovering) as receiver:
        async with asyncio.timeout(30), serve(agent, config) as h:
            request = with_webhook(send_request("a"), receiver.url())
            first = (await h.stub.SendMessage(request, metadata=V1)).task.id
            await h.stub.SendMessage(send_request("b"), metadata=V1)  # drops the first
            assert await h.service.journal.get(first) is None
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(first)),
                within=20,  # two retries, with backoff and jitter
            )
            assert_complete(receiver.frames(first), S.TASK_STATE_COMPLETED)
            await h.settle(within=10)


async def test_configs_of_a_message_only_answer_do_not_stay() -> None:
    with receiving() as receiver:
        async with asyncio.timeout(20), serve(MessageAgent(), PRIVATE) as h:
            for _ in range(3):
                request = with_webhook(send_request("hi"), receiver.url())
                answer = await h.stub.SendMessage(request, metadata=V1)
                assert answer.HasField("message")
            await h.settle(within=10)
            push = h.service.push
            assert isinstance(push, PushService) and isinstance(push.store, MemoryPushConfigs)
            assert len(push.store) == 0


async def test_one_callers_push_configs_are_bounded_over_all_its_tasks(tmp_path: Path) -> None:
    # 10 configs per task bounded nothing per caller: 150 tasks held 1,500 (issue 22).
    config = ServerConfig(
        cancel_timeout=1.0, quota_push_configs=5, push_allow_private=True, push_retry_for=0
    )
    async with asyncio.timeout(20), serve(InputAgent(), config, auth=tokens(tmp_path)) as h:
        alice = [(await h.stub.SendMessage(send_request("hi"), metadata=ALICE)).task for _ in "ab"]
        theirs = (await h.stub.SendMessage(send_request("hi"), metadata=BOB)).task

        def create(task_id: str, config_id: str, who: Any) -> Any:
            made = TaskPushNotificationConfig(  # (nothing listens: given up at once)
                task_id=task_id, id=config_id, url="http://127.0.0.1:9/"
            )
            return h.stub.CreateTaskPushNotificationConfig(made, metadata=who)

        for i in range(5):  # over alice's two tasks
            await create(alice[i % 2].id, f"c{i}", ALICE)
        await create(alice[0].id, "c0", ALICE)  # replacing one is not another
        assert await grpc_code(create(alice[1].id, "c9", ALICE)) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "PUSH_CONFIGS_QUOTA",
        )
        await create(theirs.id, "c0", BOB)  # another caller is not held up
        await h.stub.DeleteTaskPushNotificationConfig(
            DeleteTaskPushNotificationConfigRequest(task_id=alice[0].id, id="c0"), metadata=ALICE
        )
        await create(alice[1].id, "c9", ALICE)  # one deleted: room again
        for task in (*alice, theirs):
            who = BOB if task is theirs else ALICE
            await h.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=who)
        await h.settle(within=10)
