// A client generated at run time from the repository's proto/ with @grpc/grpc-js and
// @grpc/proto-loader, against a real `a2a-grpc-server serve`: the same scenarios as the
// @a2a-js/sdk suite, every call with `a2a-version: 1.0` metadata, errors read from the
// google.rpc.ErrorInfo in `grpc-status-details-bin`.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';

import * as grpc from '@grpc/grpc-js';

import { Frames } from './support/frames.mjs';
import { A2AService, richStatus } from './support/protos.mjs';
import { startServer } from './support/server.mjs';

const TEST = { timeout: 20_000 };
const CALL_WITHIN_MS = 10_000;
const A2A_DOMAIN = 'a2a-protocol.org';
const RESUME = 'urn:a2a-grpc-server:extension:resume:v1';

function v1() {
  const metadata = new grpc.Metadata();
  metadata.set('a2a-version', '1.0');
  return metadata;
}

/** Two clients of one server, each on its own connection (no shared subchannel). */
function clientsOf(server) {
  const make = () => new A2AService(server.grpcAddr, grpc.credentials.createInsecure(),
    { 'grpc.use_local_subchannel_pool': 1 });
  return [make(), make()];
}

/** A unary call, with a deadline; `metadata` defaults to `a2a-version: 1.0`. */
function unary(client, method, request, metadata = v1()) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: Date.now() + CALL_WITHIN_MS },
      (err, response) => (err ? reject(err) : resolve(response)));
  });
}

/** The state a frame carries ('TASK_STATE_…'), for a task or status-update frame. */
function stateOf(frame) {
  return frame?.payload === 'task' || frame?.payload === 'statusUpdate'
    ? frame[frame.payload].status?.state : undefined;
}

function taskIdOf(frame) {
  return frame.payload === 'task' ? frame.task.id : frame[frame.payload].taskId;
}

function request(text, contextId = '') {
  return { message: { messageId: randomUUID(), contextId, role: 'ROLE_USER', parts: [{ text }] } };
}

function streamOf(client, method, body) {
  const call = client[method](body, v1());
  return new Frames(call, () => call.cancel(), stateOf);
}

const sendStream = (client, text) => streamOf(client, 'SendStreamingMessage', request(text));
const subscribe = (client, id) => streamOf(client, 'SubscribeToTask', { id });

function assertEndedWith(frames, state, who) {
  assert.equal(frames.error, null, `${who}: the stream broke instead of ending: ${frames.error?.message}`
    + ` (states: ${frames.states().join(', ')})`);
  assert.equal(frames.lastState(), state, `${who}: last frame (states: ${frames.states().join(', ')})`);
}

/** Assert `err` is a gRPC error with `code` whose ErrorInfo says `reason` in the A2A domain. */
function assertA2AError(err, code, reason) {
  assert.equal(err.code, code, `status code of: ${err.message}`);
  const status = richStatus(err);
  assert.ok(status, `no grpc-status-details-bin on: ${err.message}`);
  assert.equal(status.code, code, 'google.rpc.Status code');
  assert.ok(status.errorInfo, 'an ErrorInfo among the details');
  assert.equal(status.errorInfo.reason, reason);
  assert.equal(status.errorInfo.domain, A2A_DOMAIN);
  return status;
}

describe('client generated from proto/ (@grpc/grpc-js + @grpc/proto-loader)', () => {
  let scripted; // tests.node.agents:Scripted: held tasks wait for a "release <id>" message
  let client;
  let other; // a second client, on its own connection
  const open = [];

  before(async () => {
    scripted = await startServer('tests.node.agents:Scripted');
    [client, other] = clientsOf(scripted);
  }, TEST);

  after(async () => {
    for (const frames of open) frames.cancel();
    client?.close();
    other?.close();
    await scripted?.stop();
  });

  const track = (frames) => (open.push(frames), frames);
  const release = (id) => unary(client, 'SendMessage', request(`release ${id}`));

  it('send: a blocking SendMessage answers the COMPLETED task with its artifact', TEST, async () => {
    const { payload, task } = await unary(client, 'SendMessage', request('complete'));
    assert.equal(payload, 'task');
    assert.equal(task.status.state, 'TASK_STATE_COMPLETED');
    assert.deepEqual(task.artifacts.map((a) => a.parts[0].text), ['result']);
  });

  it('stream: a streamed task ends with COMPLETED as its last frame', TEST, async () => {
    const sent = track(sendStream(client, 'complete'));
    await sent.drain();
    assertEndedWith(sent, 'TASK_STATE_COMPLETED', 'sender');
    assert.deepEqual(sent.frames.map((f) => f.payload),
      ['task', 'statusUpdate', 'artifactUpdate', 'statusUpdate']);
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
      const canceled = await unary(other, 'CancelTask', { id });
      assert.equal(canceled.status.state, 'TASK_STATE_CANCELED');
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
    const said = sub.frames.at(-1).statusUpdate.status.message.parts.map((p) => p.text).join(' ');
    assert.match(said, /RuntimeError/);
    assert.doesNotMatch(said, /scripted crash|Traceback/);
  });

  it('resubscribe: a stream dropped mid-task is picked up by SubscribeToTask, which ends COMPLETED',
    TEST, async () => {
      const dropped = track(sendStream(client, 'hold'));
      const id = taskIdOf(await dropped.until('TASK_STATE_WORKING'));
      dropped.cancel(); // the client goes away; the task goes on
      await dropped.drain();
      assert.equal(dropped.error?.code, grpc.status.CANCELLED, 'cancelled by the client');
      const again = track(subscribe(client, id));
      assert.equal(stateOf(await again.next()), 'TASK_STATE_WORKING');
      await release(id);
      await again.drain();
      assertEndedWith(again, 'TASK_STATE_COMPLETED', 'resubscribed');
    });

  it('GetTask and ListTasks: see ended tasks, filtered by context', TEST, async () => {
    const contextId = randomUUID();
    const { task: first } = await unary(client, 'SendMessage', request('complete', contextId));
    const { task: second } = await unary(client, 'SendMessage', request('complete', contextId));
    const got = await unary(other, 'GetTask', { id: first.id });
    assert.equal(got.id, first.id);
    assert.equal(got.contextId, contextId);
    assert.equal(got.status.state, 'TASK_STATE_COMPLETED');
    assert.equal(got.artifacts[0].artifactId, 'result');
    const listed = await unary(other, 'ListTasks', { contextId });
    assert.deepEqual(listed.tasks.map((t) => t.id).sort(), [first.id, second.id].sort());
    assert.equal(listed.totalSize, 2);
  });

  it('errors: NOT_FOUND TASK_NOT_FOUND for an unknown task, in a google.rpc.ErrorInfo', TEST,
    async () => {
      for (const [method, body] of [['GetTask', { id: 'no-such-task' }], ['CancelTask', { id: 'no-such-task' }]]) {
        const err = await unary(client, method, body).then(() => assert.fail(`${method} answered`), (e) => e);
        const status = assertA2AError(err, grpc.status.NOT_FOUND, 'TASK_NOT_FOUND');
        assert.match(status.message, /no-such-task/, 'the message names the task');
      }
    });

  it('errors: an ended task refuses cancel and subscribe (FAILED_PRECONDITION)', TEST, async () => {
    const { task } = await unary(client, 'SendMessage', request('complete'));
    const err = await unary(client, 'CancelTask', { id: task.id }).then(() => assert.fail('canceled'), (e) => e);
    assertA2AError(err, grpc.status.FAILED_PRECONDITION, 'TASK_NOT_CANCELABLE');
    const late = subscribe(client, task.id);
    await late.drain();
    assert.ok(late.error, 'SubscribeToTask of an ended task is refused');
    assertA2AError(late.error, grpc.status.FAILED_PRECONDITION, 'UNSUPPORTED_OPERATION');
  });

  it('errors: without a2a-version metadata the caller is taken for A2A 0.3 and ListTasks is refused',
    TEST, async () => {
      const err = await unary(client, 'ListTasks', {}, new grpc.Metadata())
        .then(() => assert.fail('ListTasks answered a 0.3 caller'), (e) => e);
      assertA2AError(err, grpc.status.FAILED_PRECONDITION, 'VERSION_NOT_SUPPORTED');
    });

  it('resume extension: a frame carries its payload and its seq in the metadata', TEST, async () => {
    const metadata = v1();
    metadata.set('a2a-extensions', RESUME);
    const call = client.SendStreamingMessage(request('complete'), metadata);
    const sent = track(new Frames(call, () => call.cancel(), stateOf));
    await sent.drain();
    assertEndedWith(sent, 'TASK_STATE_COMPLETED', 'sender');
    const seqs = sent.frames.map((f) => f[f.payload].metadata?.fields?.[RESUME]?.structValue
      ?.fields?.seq?.numberValue);
    assert.deepEqual(seqs, [1, 2, 3, 4]);
  });

  it('generation (A2A v1.1 Task.generation, update events 5/7)', (t) => {
    t.skip('not expressible: proto/ is the v1.0 contract (wire-identical to a2a-sdk), without '
      + 'the v1.1 generation fields; a client generated from it skips them as unknown fields');
  });
});

describe('client generated from proto/, endings settled by the server', () => {
  let stubborn; // tests.support.agents:StubbornAgent: cancel() is a no-op and execute ignores it
  let hanging; // tests.support.agents:Hanging: works until its process ends
  let clients = [];

  before(async () => {
    [stubborn, hanging] = await Promise.all([
      startServer('tests.support.agents:StubbornAgent'),
      startServer('tests.support.agents:Hanging'),
    ]);
    clients = [...clientsOf(stubborn), ...clientsOf(hanging)];
  }, TEST);

  const open = [];
  const track = (frames) => (open.push(frames), frames);

  after(async () => {
    for (const frames of open) frames.cancel();
    for (const c of clients) c.close();
    await Promise.all([stubborn?.stop(), hanging?.stop()]);
  });

  it('cancel with a no-op cancel(): CancelTask answers CANCELED; both streams end CANCELED', TEST,
    async () => {
      const [client, other] = clients;
      const sent = track(sendStream(client, 'work'));
      const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
      const sub = track(subscribe(other, id));
      await sub.next();
      const canceled = await unary(client, 'CancelTask', { id });
      assert.equal(canceled.status.state, 'TASK_STATE_CANCELED');
      await Promise.all([sent.drain(), sub.drain()]);
      assertEndedWith(sent, 'TASK_STATE_CANCELED', 'sender');
      assertEndedWith(sub, 'TASK_STATE_CANCELED', 'second client');
      const task = await unary(other, 'GetTask', { id });
      assert.equal(task.status.state, 'TASK_STATE_CANCELED', 'late events changed nothing');
    });

  it('server shutdown (SIGTERM) with a task still running: both streams end FAILED', TEST,
    async () => {
      const [, , client, other] = clients;
      const sent = track(sendStream(client, 'work'));
      const id = taskIdOf(await sent.until('TASK_STATE_WORKING'));
      const sub = track(subscribe(other, id));
      assert.equal(stateOf(await sub.next()), 'TASK_STATE_WORKING');
      const exited = hanging.terminate();
      await Promise.all([sent.drain(), sub.drain()]);
      assertEndedWith(sent, 'TASK_STATE_FAILED', 'sender');
      assertEndedWith(sub, 'TASK_STATE_FAILED', 'second client');
      const said = sub.frames.at(-1).statusUpdate.status.message?.parts.map((p) => p.text).join(' ');
      assert.match(said ?? '', /shutting down/, 'the final frame says why');
      assert.deepEqual(await exited, { code: 0, signal: null }, hanging.tail());
    });
});
