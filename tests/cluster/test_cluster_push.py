"""Push notifications in cluster mode on a real nats-server: configs shared by every instance,
delivered by the task's owner, and continued by the survivor that ends a lost owner's task."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    TaskPushNotificationConfig,
    TaskState,
)

from a2a_grpc_server import ServerConfig
from tests.support.agents import GatedPerTask, InputAgent
from tests.support.clusterharness import Instance, collect, instances
from tests.support.harness import ALICE, BOB, V1, rich_status, send_request, tokens
from tests.support.serveproc import owner_process
from tests.support.webhook import Answer, Post, assert_complete, receiving, with_webhook

S = TaskState
LEASE = 1.0
PUSHING = ServerConfig(cancel_timeout=1.0, push_allow_private=True)
"""The receiver listens on 127.0.0.1."""


async def test_a_config_made_through_another_instance_is_delivered_by_the_owner(
    nats_url: str,
) -> None:
    agent = GatedPerTask()
    with receiving() as receiver:
        async with (
            asyncio.timeout(30),
            instances(agent, [nats_url], config=PUSHING) as (a, b),
        ):
            assert a.service.card.capabilities.push_notifications
            sender = a.client.send_message_streaming(send_request("go"))
            task_id = (await anext(sender)).task.id
            assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
            made = await b.stub.CreateTaskPushNotificationConfig(
                TaskPushNotificationConfig(task_id=task_id, id="hook", url=receiver.url()),
                metadata=V1,
            )
            # Shared: every instance reads it.
            for instance in (a, b):
                got = await instance.stub.GetTaskPushNotificationConfig(
                    GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook"), metadata=V1
                )
                assert got == made
            listed = await a.stub.ListTaskPushNotificationConfigs(
                ListTaskPushNotificationConfigsRequest(task_id=task_id), metadata=V1
            )
            assert [c.id for c in listed.configs] == ["hook"]
            a_push = a.service.push
            assert a_push is not None and a_push.dispatcher.following(task_id) == 1, (
                "the owner delivers it"
            )
            agent.release(task_id)
            await collect(sender)
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id))
            )
            posts = receiver.frames(task_id)
            assert_complete(posts, S.TASK_STATE_COMPLETED, first_seq=posts[0].seq)
            await b.stub.DeleteTaskPushNotificationConfig(
                DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="hook"), metadata=V1
            )
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await a.stub.GetTaskPushNotificationConfig(
                    GetTaskPushNotificationConfigRequest(task_id=task_id, id="hook"), metadata=V1
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            b_push = b.service.push
            assert b_push is not None and b_push.dispatcher.count == 0, "only the owner delivers"


async def test_the_survivor_delivers_the_failed_frame_of_a_lost_owners_task(
    nats_url: str,
) -> None:
    with receiving() as receiver:
        async with (
            owner_process(nats_url, LEASE, "--push-allow-private") as (owner, client),
            asyncio.timeout(30),
            instances(
                GatedPerTask(), [nats_url], names=("B", "C"), lease=LEASE, config=PUSHING
            ) as (b, c),
        ):
            request = with_webhook(send_request("go"), receiver.url())
            sender = client.send_message_streaming(request)
            task_id = (await anext(sender)).task.id
            assert (await anext(sender)).status_update.status.state == S.TASK_STATE_WORKING
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_WORKING for p in receiver.frames(task_id))
            )
            for survivor in (b, c):  # (every instance publishes delivery entries)
                await survivor.cluster.push_coverage.covered.wait()
            lookups = record_orphan_lookups(b, c)
            owner.proc.kill()  # SIGKILL: the owner delivers nothing more
            await owner.proc.wait()
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_FAILED for p in receiver.frames(task_id)),
                within=LEASE * 6,
            )
            posts = receiver.frames(task_id)
            assert_complete(posts, S.TASK_STATE_FAILED)
            assert "was lost" in posts[-1].frame.status_update.status.message.parts[0].text
            reaped = b.service.metrics.tasks_reaped + c.service.metrics.tasks_reaped
            assert reaped == 1
            assert lookups and all(indexed for _, indexed in lookups), (
                "the orphan was found through the lost owner's delivery entries",
                lookups,
            )


async def test_a_survivor_resumes_a_final_frame_the_lost_owner_was_still_retrying(
    nats_url: str,
) -> None:
    allow = threading.Event()

    def refuse_the_end_until_allowed(post: Post, attempt: int) -> Answer:
        ended = post.state == S.TASK_STATE_COMPLETED
        return Answer(503) if ended and not allow.is_set() else Answer(204)

    agent = "tests.support.agents:instance"
    with receiving(refuse_the_end_until_allowed) as receiver:
        async with (
            owner_process(nats_url, LEASE, "--push-allow-private", agent=agent) as (owner, client),
            asyncio.timeout(30),
            instances(
                GatedPerTask(), [nats_url], names=("B", "C"), lease=LEASE, config=PUSHING
            ) as (b, c),
        ):
            request = with_webhook(send_request("hi"), receiver.url())
            answer = await client.send_message(request)
            task_id = answer.task.id
            assert answer.task.status.state == S.TASK_STATE_COMPLETED
            await receiver.wait_for(  # the owner is retrying the final frame...
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.attempts)
            )
            owner.proc.kill()  # ...and is lost
            await owner.proc.wait()
            allow.set()
            await receiver.wait_for(
                lambda: any(p.state == S.TASK_STATE_COMPLETED for p in receiver.frames(task_id)),
                within=LEASE * 8,
            )
            assert_complete(receiver.frames(task_id), S.TASK_STATE_COMPLETED)
            for survivor in (b, c):  # (a delivery counts once its answer is back)
                await survivor.service.engine.wait_idle()
            adopted = b.service.metrics.push_deliveries["delivered"]
            adopted += c.service.metrics.push_deliveries["delivered"]
            assert adopted >= 1, "a survivor delivered it"


async def test_one_callers_push_configs_are_bounded_over_the_cluster(
    nats_url: str, tmp_path: Path
) -> None:
    # In cluster mode only push_max_configs per task bounded a caller: the shared bucket had
    # no count by principal, so a caller's tasks could hold any number (issue 22).
    config = ServerConfig(
        cancel_timeout=1.0, quota_push_configs=3, push_allow_private=True, push_retry_for=0
    )
    async with (
        asyncio.timeout(60),
        instances(InputAgent(), [nats_url], config=config, auth=tokens(tmp_path)) as (a, b),
    ):
        alice = [(await a.stub.SendMessage(send_request("hi"), metadata=ALICE)).task for _ in "ab"]
        theirs = (await a.stub.SendMessage(send_request("hi"), metadata=BOB)).task

        def create(via: Instance, task_id: str, config_id: str, who: Any) -> Any:
            made = TaskPushNotificationConfig(  # (nothing listens: given up at once)
                task_id=task_id, id=config_id, url="http://127.0.0.1:9/"
            )
            return via.stub.CreateTaskPushNotificationConfig(made, metadata=who)

        await create(a, alice[0].id, "c0", ALICE)  # through the owner
        await create(b, alice[0].id, "c1", ALICE)  # through the other instance
        await create(b, alice[1].id, "c2", ALICE)
        await create(a, alice[1].id, "c2", ALICE)  # replacing one is not another
        for via in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await create(via, alice[1].id, "c3", ALICE)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert rich_status(caught.value)[1].reason == "PUSH_CONFIGS_QUOTA"
        await create(b, theirs.id, "c0", BOB)  # another caller is not held up
        await b.stub.DeleteTaskPushNotificationConfig(
            DeleteTaskPushNotificationConfigRequest(task_id=alice[0].id, id="c0"), metadata=ALICE
        )
        await create(a, alice[1].id, "c3", ALICE)  # one deleted: room again
        for task in (*alice, theirs):
            who = BOB if task is theirs else ALICE
            await a.stub.CancelTask(CancelTaskRequest(id=task.id), metadata=who)


def record_orphan_lookups(*survivors: Instance) -> list[tuple[str, bool]]:
    """Each survivor's lookups of orphaned push configs from now on: whether indexed."""
    lookups: list[tuple[str, bool]] = []
    for survivor in survivors:
        store = survivor.cluster.push_store
        orphans = store.orphans

        async def counted(
            alive: set[str],
            *,
            indexed: bool = False,
            name: str = survivor.name,
            orphans: Any = orphans,
        ) -> Any:
            lookups.append((name, indexed))
            return await orphans(alive, indexed=indexed)

        store.orphans = counted  # type: ignore[method-assign]
    return lookups
