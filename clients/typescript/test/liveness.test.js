// Answers the real server never gives, from a scripted one: each must leave the lease (or the
// claim) as the contract says.

import assert from 'node:assert/strict';
import net from 'node:net';
import { test } from 'node:test';

import { Client, LeaseLost, ProblemError, fencedBody } from '../src/index.js';
import { fakeServer, grant, problem } from './fake-server.js';
import { sleep } from './helpers.js';

test('a renewal that never answers is abandoned and asked again', async (t) => {
  const server = await fakeServer(t, (action, body, n) => (action === 'renew' && n === 0 ? null : grant(body)));
  // A 6 s lease: renewed every 2 s, the hung attempt given up after 2 s and the renewal asked
  // again some 0.5 s later, almost a second before the deadline (5.4 s): room for a loaded
  // machine. Were the attempt given all the time left, it would use up the lease.
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 6000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  await sleep(6000); // past the claim's deadline: only a later renewal keeps the lease
  assert.equal(lease.isLost(), false, lease.lossReason);
  assert.ok(server.count('renew') >= 2);
  lease.abandon();
});

test('a release answered 408 body-timeout is asked again', async (t) => {
  const server = await fakeServer(t, (action, body, n) => {
    if (action === 'release' && n === 0) return problem(408, 'body-timeout');
    if (action === 'release') {
      return [200, { 'content-type': 'application/json' }, JSON.stringify({ job: 'j', owner: null, generation: 1, state: 'free', expires_in_ms: 0 })];
    }
    return grant(body);
  });
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 5000 });
  t.after(() => client.close());
  const record = await (await client.claim('j')).release();
  assert.equal(record.state, 'free');
  assert.equal(server.count('release'), 2);
});

test("a claim answered a gateway's 408 is asked again with the same key", async (t) => {
  const server = await fakeServer(t, (action, body, n) => (action === 'claim' && n === 0
    ? [408, { 'content-type': 'text/plain' }, 'request timeout'] : grant(body)));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 5000 });
  t.after(() => client.close());
  await assert.rejects(client.claim('j'), (e) => e instanceof ProblemError && e.status === 408);
  (await client.claim('j')).abandon();
  const keys = server.seen.filter((s) => s.action === 'claim').map((s) => s.body.lease_key);
  assert.equal(keys.length, 2);
  assert.equal(keys[0], keys[1]);
});

test('a waiting claim refused for too many waiters asks again within its wait', async (t) => {
  const server = await fakeServer(t, (action, body, n) => (action === 'claim' && n < 2
    ? problem(429, 'too-many-waiters', { 'retry-after': '0' }) : grant(body)));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 5000 });
  t.after(() => client.close());
  (await client.claim('j', { waitMs: 5000 })).abandon();
  assert.equal(server.count('claim'), 3);
});

test('a grant above the TTL asked does not move the deadline past it', async (t) => {
  // Every grant ten times what was asked: the deadline still counts from the 1 s asked.
  const server = await fakeServer(t, (action, body) => grant(body, 10 * body.ttl_ms));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  assert.equal(lease.ttlMs, 10_000);
  assert.ok(lease.deadline <= performance.now() + 900, `deadline ${lease.deadline - performance.now()} ms out`);
  // Renewed before the asked TTL's deadline (not a third of 10 s), each counted from 1 s.
  const until = performance.now() + 3000;
  while (server.count('renew') < 2) {
    assert.ok(performance.now() < until, 'not renewed as the asked TTL needs');
    await sleep(10);
  }
  assert.ok(lease.deadline <= performance.now() + 900 && !lease.isLost(), lease.lossReason);
  lease.abandon();
});

const echo = (status, body) => [status, { 'content-type': 'text/plain' }, JSON.stringify(body)];

test('an endpoint that echoes the request never puts the lease key in errors', async (t) => {
  // Renewals answered 200 with the request itself: not a grant, and the loss reason says why.
  const server = await fakeServer(t, (action, body) => (action === 'claim' ? grant(body) : echo(200, body)));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  const key = server.seen[0].body.lease_key;
  await new Promise((r) => lease.signal.addEventListener('abort', r, { once: true }));
  assert.ok(lease.lossReason.includes('expires_at_ms') && !lease.lossReason.includes(key), lease.lossReason);
  assert.throws(() => lease.token, (e) => e instanceof LeaseLost && !e.message.includes(key));
  // A refusal whose body is the request: its detail is in the error, the key is not.
  const refusing = await fakeServer(t, (action, body) => echo(400, body));
  const other = new Client({ server: refusing.url, owner: 'o', ttlMs: 1000 });
  t.after(() => other.close());
  await assert.rejects(other.claim('j'), (e) => e instanceof ProblemError && e.message.includes('lease_key')
    && !e.message.includes(refusing.seen[0].body.lease_key));
});

test('a body wrapped by fencedBody is cut at the loss', async (t) => {
  const server = await fakeServer(t, (action, body) => (action === 'renew' ? null : grant(body)));
  // A destination that records the raw bytes of each connection until it ends.
  const received = [];
  const sink = net.createServer((socket) => {
    const chunks = [];
    socket.on('data', (c) => chunks.push(c));
    socket.on('close', () => received.push(Buffer.concat(chunks).toString()));
    socket.on('error', () => {});
  });
  await new Promise((r) => sink.listen(0, '127.0.0.1', r));
  t.after(() => sink.close());
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  async function* slow() {
    yield 'first chunk';
    await sleep(1500); // past the lease's deadline
    yield 'second chunk';
  }
  const url = `http://127.0.0.1:${sink.address().port}/upload`;
  await assert.rejects(fetch(url, { method: 'POST', body: fencedBody(lease, slow()), duplex: 'half', signal: AbortSignal.timeout(5000) }),
    (e) => e instanceof LeaseLost || e?.cause instanceof LeaseLost);
  const until = performance.now() + 5000;
  while (received.length === 0) {
    assert.ok(performance.now() < until, 'the sink saw no connection end');
    await sleep(10);
  }
  assert.ok(received[0].includes('first chunk'), received[0]);
  assert.ok(!received[0].includes('second chunk') && !received[0].endsWith('0\r\n\r\n'), received[0]);
});

test('fencedBody reads nothing ahead: a chunk is checked when it is taken', async (t) => {
  const server = await fakeServer(t, (action, body) => grant(body));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 5000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  const body = fencedBody(lease, ['a', 'b']);
  await sleep(0); // a stream that reads ahead has taken 'a' by now, checked while the lease held
  lease.abandon();
  await assert.rejects(body.getReader().read(), (e) => e instanceof LeaseLost);
});

test('a lease key cut short, in a parse error or in a problem object is not shown', async (t) => {
  const { inspect } = await import('node:util');
  const { problemError } = await import('../src/errors.js');
  const key = `KEYPART${'k'.repeat(36)}`;
  // A text answer quoted up to 500 characters, its cut 7 characters into the key.
  const cut = problemError(400, 'text/plain', `${'x'.repeat(500 - 'lease_key":"'.length - 7)}lease_key":"${key}"}`);
  assert.ok(cut.message.includes('lease_key') && !cut.message.includes('KEYPART'), cut.message);
  // A problem that echoes the request: the key is in no printout of the error.
  const echoed = problemError(409, 'application/problem+json', JSON.stringify({ type: 'urn:x', detail: 'd', lease_key: key }));
  assert.equal(echoed.problem.lease_key, key);
  assert.ok(!inspect(echoed).includes('KEYPART') && !JSON.stringify(echoed).includes('KEYPART'), inspect(echoed));
  // A 200 that is not JSON: JSON.parse's error quotes the text after `"ease_key":`.
  const server = await fakeServer(t, (action, body) => [200, { 'content-type': 'text/plain' }, `{"lease_key":${body.lease_key}}`]);
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 1000 });
  t.after(() => client.close());
  const error = await client.claim('j').then(() => null, (e) => e);
  const sent = server.seen[0].body.lease_key;
  assert.ok(error?.message.includes('not a JSON object') && !inspect(error).includes(sent.slice(0, 8)), inspect(error));
});
