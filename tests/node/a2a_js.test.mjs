// @a2a-js/sdk's gRPC client (GrpcTransportFactory, found through the served agent card)
// against a real `a2a-grpc-server serve`: every scenario asserts each stream's last frame.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';

import {
  CancelTaskRequest,
  GetTaskRequest,
  ListTasksRequest,
  SendMessageRequest,
  SubscribeToTaskRequest,
  TaskState,
} from '@a2a-js/sdk';
import {
  ClientFactory,
  ClientFactoryOptions,
  ServiceParameters,
  withA2AExtensions,
} from '@a2a-js/sdk/client';
import { GrpcTransportFactory } from '@a2a-js/sdk/client/grpc';

import { Frames } from './support/frames.mjs';
import { startServer } from './support/server.mjs';

const TEST = { timeout: 20_000 };
const RESUME = 'urn:a2a-grpc-server:extension:resume:v1';

/** The state a frame carries ('TASK_STATE_…'), for a task or status-update frame. */
function stateOf(frame) {
  const { $case, value } = frame?.payload ?? {};
  const state = $case === 'task' || $case === 'statusUpdate' ? value.status?.state : undefined;
  return state === undefined ? undefined : TaskState[state];
}

function taskIdOf(frame) {
  const { $case, value } = frame.payload;
  return $case === 'task' ? value.id : value.taskId;
}

function request(text, contextId = '') {
  return SendMessageRequest.fromJSON({
    message: { messageId: randomUUID(), contextId, role: 'ROLE_USER', parts: [{ text }] },
  });
}

/** A client of `server`, made as an application makes one: from its agent card, over gRPC. */
async function clientOf(server) {
  const factory = new ClientFactory(ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new GrpcTransportFactory()],
    preferredTransports: ['GRPC'],
  }));
  return factory.createFromUrl(server.cardOrigin);
}

/** A stream call of `client` (sendMessageStream or resubscribeTask) as Frames. */
function framesOf(call) {
  const abort = new AbortController();
  return new Frames(call({ signal: abort.signal }), () => abort.abort(), stateOf);
}

function sendStream(client, text) {
  return framesOf((options) => client.sendMessageStream(request(text), options));
}

function subscribe(client, id) {
  return framesOf((options) => client.resubscribeTask(SubscribeToTaskRequest.fromJSON({ id }), options));
}

/** Assert the stream ended cleanly (status OK) right after a frame in `state`. */
function assertEndedWith(frames, state, who) {
  assert.equal(frames.error, null, `${who}: the stream broke instead of ending: ${frames.error?.message}`
    + ` (states: ${frames.states().join(', ')})`);
  assert.equal(frames.lastState(), state, `${who}: last frame (states: ${frames.states().join(', ')})`);
}

describe('@a2a-js/sdk 1.3 gRPC client', () => {
  let scripted; // tests.node.agents:Scripted: held tasks wait for a "release <id>" message
  let client; // its first client
  let other; // a second client of it
  const open = []; // streams to cancel if a test fails midway

  before(async () => {
    scripted = await startServer('tests.node.agents:Scripted');
    client = await clientOf(scripted);
    other = await clientOf(scripted);
  }, TEST);

  after(async () => {
    for (const frames of open) frames.cancel();
    await scripted?.stop();
  });

  const track = (frames) => (open.push(frames), frames);
  const release = (id) => client.sendMessage(request(`release ${id}`));

  it('finds the gRPC interface on the agent card and speaks A2A 1.0', () => {
    assert.equal(client.transport.protocolName, 'GRPC');
    assert.equal(client.protocolVersion, '1.0');
  });

  it('send: a blocking SendMessage answers the COMPLETED task with its artifact', TEST, async () => {
    const task = await client.sendMessage(request('complete'));
    assert.equal(TaskState[task.status.state], 'TASK_STATE_COMPLETED');
    assert.deepEqual(task.artifacts.map((a) => a.parts[0].content), [{ $case: 'text', value: 'result' }]);
  });

  it('stream: a streamed task ends with COMPLETED as its last frame', TEST, async () => {
    const sent = track(sendStream(client, 'complete'));
    await sent.drain();
    assertEndedWith(sent, 'TASK_STATE_COMPLETED', 'sender');
    assert.ok(sent.frames.some((f) => f.payload.$case === 'artifactUpdate'), 'an artifact frame');
  });

  it('subscribe from a second client: both streams end COMPLETED once released', TEST, async () => {
    const sent = track(sendStream(client, 'hold'));
    const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
    const sub = track(subscribe(other, id));
    assert.equal(stateOf(await sub.next()), 'TASK_STATE_WORKING'); // the task as it is
    await release(id);
    await Promise.all([sent.drain(), sub.drain()]);
    assertEndedWith(sent, 'TASK_STATE_COMPLETED', 'sender');
    assertEndedWith(sub, 'TASK_STATE_COMPLETED', 'second client');
  });

  it('cancel (cooperative cancel()): CancelTask answers CANCELED; both streams end CANCELED', TEST,
    async () => {
      const sent = track(sendStream(client, 'hold'));
      const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
      const sub = track(subscribe(other, id));
      await sub.next();
      const canceled = await other.cancelTask(CancelTaskRequest.fromJSON({ id }));
      assert.equal(TaskState[canceled.status.state], 'TASK_STATE_CANCELED');
      await Promise.all([sent.drain(), sub.drain()]);
      assertEndedWith(sent, 'TASK_STATE_CANCELED', 'sender');
      assertEndedWith(sub, 'TASK_STATE_CANCELED', 'second client');
    });

  it('executor raising: both streams end FAILED, naming the error class only', TEST, async () => {
    const sent = track(sendStream(client, 'crash'));
    const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
    const sub = track(subscribe(other, id));
    await sub.next();
    await release(id);
    await Promise.all([sent.drain(), sub.drain()]);
    assertEndedWith(sent, 'TASK_STATE_FAILED', 'sender');
    assertEndedWith(sub, 'TASK_STATE_FAILED', 'second client');
    const task = await client.getTask(GetTaskRequest.fromJSON({ id }));
    assert.equal(TaskState[task.status.state], 'TASK_STATE_FAILED');
    const said = JSON.stringify(task.status.message ?? {});
    assert.match(said, /RuntimeError/);
    assert.doesNotMatch(said, /scripted crash|Traceback/);
  });

  it('resubscribe: a stream dropped mid-task is picked up by SubscribeToTask, which ends COMPLETED',
    TEST, async () => {
      const dropped = track(sendStream(client, 'hold'));
      const id = taskIdOf(await dropped.until('TASK_STATE_WORKING'));
      dropped.cancel(); // the client goes away; the task goes on
      const again = track(subscribe(client, id));
      assert.equal(stateOf(await again.next()), 'TASK_STATE_WORKING');
      await release(id);
      await again.drain();
      assertEndedWith(again, 'TASK_STATE_COMPLETED', 'resubscribed');
    });

  it('GetTask and ListTasks: see ended tasks, filtered by context', TEST, async () => {
    const contextId = randomUUID();
    const first = await client.sendMessage(request('complete', contextId));
    const second = await client.sendMessage(request('complete', contextId));
    const got = await other.getTask(GetTaskRequest.fromJSON({ id: first.id }));
    assert.equal(got.id, first.id);
    assert.equal(got.contextId, contextId);
    assert.equal(TaskState[got.status.state], 'TASK_STATE_COMPLETED');
    assert.equal(got.artifacts[0].artifactId, 'result');
    const listed = await other.listTasks(ListTasksRequest.fromJSON({ contextId }));
    assert.deepEqual(listed.tasks.map((t) => t.id).sort(), [first.id, second.id].sort());
    assert.equal(listed.totalSize, 2);
  });

  it('errors: unknown task, ended task: the SDK error classes, from ErrorInfo reasons', TEST,
    async () => {
      await assert.rejects(client.getTask(GetTaskRequest.fromJSON({ id: 'no-such-task' })),
        (err) => err.name === 'TaskNotFoundError' && err.status === 5 /* NOT_FOUND */);
      const done = await client.sendMessage(request('complete'));
      await assert.rejects(client.cancelTask(CancelTaskRequest.fromJSON({ id: done.id })),
        (err) => err.name === 'TaskNotCancelableError' && err.status === 9 /* FAILED_PRECONDITION */);
      const late = subscribe(client, done.id);
      await late.drain();
      assert.equal(late.error?.name, 'UnsupportedOperationError', `subscribe to an ended task: ${late.error}`);
    });

  it('resume extension: a frame carries its payload and its seq in the metadata', TEST, async () => {
    const serviceParameters = ServiceParameters.create(withA2AExtensions(RESUME));
    const sent = track(framesOf((options) =>
      client.sendMessageStream(request('complete'), { ...options, serviceParameters })));
    await sent.drain();
    assertEndedWith(sent, 'TASK_STATE_COMPLETED', 'sender');
    assert.deepEqual(sent.frames.map((f) => f.payload.value.metadata?.[RESUME]?.seq), [1, 2, 3, 4]);
  });

  it('generation (A2A v1.1 Task.generation, update events 5/7)', (t) => {
    t.skip('not expressible: @a2a-js/sdk 1.3 has the v1.0 types, without generation fields '
      + '(its decoder skips them as unknown fields)');
  });
});

describe('@a2a-js/sdk 1.3 gRPC client, endings settled by the server', () => {
  let stubborn; // tests.support.agents:StubbornAgent: cancel() is a no-op and execute ignores it
  let hanging; // tests.support.agents:Hanging: works until its process ends
  let a;
  let b;
  const open = [];

  before(async () => {
    [stubborn, hanging] = await Promise.all([
      startServer('tests.support.agents:StubbornAgent'),
      startServer('tests.support.agents:Hanging'),
    ]);
    a = await clientOf(stubborn);
    b = await clientOf(hanging);
  }, TEST);

  after(async () => {
    for (const frames of open) frames.cancel();
    await Promise.all([stubborn?.stop(), hanging?.stop()]);
  });

  const track = (frames) => (open.push(frames), frames);

  it('cancel with a no-op cancel(): CancelTask answers CANCELED; the stream ends CANCELED', TEST,
    async () => {
      const sent = track(sendStream(a, 'work'));
      const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
      const canceled = await a.cancelTask(CancelTaskRequest.fromJSON({ id }));
      assert.equal(TaskState[canceled.status.state], 'TASK_STATE_CANCELED');
      await sent.drain();
      assertEndedWith(sent, 'TASK_STATE_CANCELED', 'sender');
      const task = await a.getTask(GetTaskRequest.fromJSON({ id }));
      assert.equal(TaskState[task.status.state], 'TASK_STATE_CANCELED', 'late events changed nothing');
    });

  it('server shutdown (SIGTERM) with a task still running: both streams end FAILED', TEST,
    async () => {
      const sent = track(sendStream(b, 'work'));
      const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
      const sub = track(subscribe(b, id));
      assert.equal(stateOf(await sub.next()), 'TASK_STATE_WORKING');
      const exited = hanging.terminate();
      await Promise.all([sent.drain(), sub.drain()]);
      assertEndedWith(sent, 'TASK_STATE_FAILED', 'sender');
      assertEndedWith(sub, 'TASK_STATE_FAILED', 'subscriber');
      const said = sub.frames.at(-1).payload.value.status.message?.parts
        .map((p) => p.content?.value).join(' ');
      assert.match(said ?? '', /shutting down/, 'the final frame says why');
      assert.deepEqual(await exited, { code: 0, signal: null }, hanging.tail());
    });
});
