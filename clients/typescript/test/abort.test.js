// A claim given up with its `signal` (a request handler that gave up, a wait cut short): it
// rejects with the signal's reason at once, and leaves no lease renewed for nobody. A claim
// raced against a timer instead ran on, and the lease it won was kept by its keeper until the
// process exited.

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import { Client } from '../src/index.js';
import { Transport } from '../src/wire.js';
import { sleep, stack, waitFor } from './helpers.js';

/**
 * A front for the lease server that forwards everything and records each request (path, body,
 * when). `hold(req, body)` may take a request instead (return true): it is then not forwarded,
 * and its connection is left to the client; `delay(req)` ms before forwarding.
 */
async function front(t, serverUrl, { hold = () => false, delay = () => 0 } = {}) {
  const target = new URL(serverUrl);
  const seen = [];
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', async () => {
      const text = Buffer.concat(chunks).toString();
      const body = text ? JSON.parse(text) : undefined;
      seen.push({ path: req.url, body, at: performance.now() });
      if (hold(req, body)) return;
      const ms = delay(req);
      if (ms > 0) await sleep(ms);
      const out = http.request({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
        res.writeHead(answer.statusCode, answer.headers);
        answer.pipe(res);
      });
      out.on('error', () => res.destroy());
      out.end(text);
    });
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  t.after(() => { server.closeAllConnections(); server.close(); });
  return { url: `http://127.0.0.1:${server.address().port}`, seen };
}

const ofPath = (seen, suffix) => seen.filter((r) => r.path.split('?')[0].endsWith(suffix));

test('a waiting claim given up rejects with the reason at once and is granted nothing', async (t) => {
  const s = await stack(t, { proxy: false });
  const holder = new Client({ server: s.serverUrl, owner: 'holder', ttlMs: 30_000 });
  const waiter = new Client({ server: s.serverUrl, owner: 'waiter', ttlMs: 30_000 });
  t.after(() => { holder.close(); waiter.close(); });
  const held = await holder.claim('wanted');
  const controller = new AbortController();
  const reason = new Error('the request handler gave up');
  setTimeout(() => controller.abort(reason), 300);
  let started = performance.now();
  await assert.rejects(waiter.claim('wanted', { waitMs: 20_000, signal: controller.signal }), (e) => e === reason);
  let took = performance.now() - started;
  assert.ok(took >= 290 && took < 800, `rejected after ${took} ms of a 20 s wait`);
  // AbortSignal.timeout, as the README shows: its reason is a TimeoutError.
  started = performance.now();
  await assert.rejects(waiter.claim('wanted', { waitMs: 20_000, signal: AbortSignal.timeout(300) }),
    (e) => e instanceof DOMException && e.name === 'TimeoutError');
  took = performance.now() - started;
  assert.ok(took >= 290 && took < 800, `rejected after ${took} ms of a 20 s wait`);
  assert.equal((await waiter.status('wanted')).owner, 'holder');
  // The server dropped the waiting claims with their connections: once the job is free, it
  // stays free, granted to nobody (a claim left waiting would now be granted to the waiter).
  await held.release();
  await sleep(300);
  const record = await waiter.status('wanted');
  assert.deepEqual([record.state, record.owner, record.generation], ['free', null, 1n]);
  // The waiter's next claim is an ordinary one.
  const lease = await waiter.claim('wanted');
  assert.equal(lease.generation, 2n);
  await lease.release();
});

test('a signal aborted before the call rejects with its reason, and nothing is sent', async (t) => {
  let requests = 0;
  let connections = 0;
  const server = http.createServer((req, res) => { requests += 1; res.destroy(); });
  server.on('connection', () => { connections += 1; });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  t.after(() => server.close());
  const client = new Client({ server: `http://127.0.0.1:${server.address().port}`, owner: 'early' });
  t.after(() => client.close());
  const controller = new AbortController();
  controller.abort();
  for (const call of [() => client.claim('early', { signal: controller.signal, waitMs: 5000 }),
    () => client.claimSlot('early', 2, { signal: controller.signal, waitMs: 5000 })]) {
    await assert.rejects(call(), (e) => e === controller.signal.reason && e instanceof DOMException && e.name === 'AbortError');
  }
  const reason = new Error('mine');
  await assert.rejects(client.claim('early', { signal: AbortSignal.abort(reason) }), (e) => e === reason);
  // A signal that is not an AbortSignal is refused before sending.
  for (const signal of [{ aborted: false, addEventListener() {} }, controller, 'abort', 5]) {
    await assert.rejects(client.claim('early', { signal }), TypeError);
    await assert.rejects(client.claimSlot('early', 2, { signal }), TypeError);
  }
  await sleep(50);
  assert.deepEqual([requests, connections], [0, 0]);
});

/** Resolves once the server records `job` as free; fails after `withinMs`. */
async function freeWithin(client, job, withinMs) {
  const until = performance.now() + withinMs;
  let record;
  while ((record = await client.status(job)).state !== 'free') {
    assert.ok(performance.now() < until, `${job} is still ${record.state} (${record.owner}) after ${withinMs} ms: not given back`);
    await sleep(10);
  }
  return record;
}

test('a grant whose answer is read after the abort is given back, no keeper started', async (t) => {
  const s = await stack(t, { proxy: false });
  const f = await front(t, s.serverUrl);
  const observer = new Client({ server: s.serverUrl, owner: 'observer' });
  t.after(() => observer.close());
  // The answer is read, and only then does the signal abort (in the instant the answer came
  // in, too late for the transport to cut the request).
  const controller = new AbortController();
  const reason = new Error('given up');
  const real = Transport.prototype.call;
  Transport.prototype.call = async function late(method, path, body, timeoutMs) {
    const answer = await real.call(this, method, path, body, timeoutMs); // the signal not passed on
    if (path.startsWith('/v1/leases/late-grant/claim')) controller.abort(reason);
    return answer;
  };
  t.after(() => { Transport.prototype.call = real; });
  const client = new Client({ server: f.url, owner: 'quitter', ttlMs: 1000 });
  t.after(() => client.close());
  await assert.rejects(client.claim('late-grant', { signal: controller.signal }), (e) => e === reason);
  Transport.prototype.call = real;
  // Released under the grant's generation and the claim's key.
  await waitFor('a release', 3000, () => ofPath(f.seen, '/release').length > 0);
  const [claim] = ofPath(f.seen, '/claim');
  assert.deepEqual(ofPath(f.seen, '/release').map((r) => r.body),
    [{ owner: 'quitter', generation: 1, lease_key: claim.body.lease_key }]);
  assert.equal((await freeWithin(observer, 'late-grant', 3000)).generation, 1n);
  // No keeper: a 1 s lease would have been renewed three or four times by now.
  await sleep(1200);
  assert.deepEqual(ofPath(f.seen, '/renew'), []);
  // Its key was not kept (given back, a claim with it could free the next holder's lease):
  // the next claim asks with a new one.
  const lease = await client.claim('late-grant');
  const claims = ofPath(f.seen, '/claim');
  assert.equal(claims.length, 2);
  assert.notEqual(claims[1].body.lease_key, claims[0].body.lease_key);
  assert.equal(lease.generation, 2n);
  await lease.release();
});

test('a grant aborted during its first renewal (a late grant) is given back', async (t) => {
  // A claim answered late has little of its TTL left, and is renewed once before it is
  // handed over: an abort then cuts that renewal, and the grant is given back.
  const s = await stack(t, { proxy: false });
  const controller = new AbortController();
  const reason = new Error('given up during the renewal');
  let abortedAt;
  const f = await front(t, s.serverUrl, {
    delay: (req) => (req.url.startsWith('/v1/leases/late-renewal/claim') ? 500 : 0),
    hold: (req) => {
      if (!req.url.endsWith('/renew')) return false;
      abortedAt = performance.now();
      controller.abort(reason);
      return true; // never answered: only the signal ends it
    },
  });
  const observer = new Client({ server: s.serverUrl, owner: 'observer' });
  const client = new Client({ server: f.url, owner: 'quitter', ttlMs: 1000 });
  t.after(() => { observer.close(); client.close(); });
  await assert.rejects(client.claim('late-renewal', { signal: controller.signal }), (e) => e === reason);
  const took = performance.now() - abortedAt;
  assert.ok(took < 200, `rejected ${took} ms after the abort`);
  await waitFor('a release', 3000, () => ofPath(f.seen, '/release').length > 0);
  const [claim] = ofPath(f.seen, '/claim');
  assert.deepEqual(ofPath(f.seen, '/release').map((r) => r.body),
    [{ owner: 'quitter', generation: 1, lease_key: claim.body.lease_key }]);
  await freeWithin(observer, 'late-renewal', 3000);
  await sleep(1200);
  assert.equal(ofPath(f.seen, '/renew').length, 1, 'a keeper renewed the lease given up');
});

test('a claim cut under way keeps its key for the next claim of the job', async (t) => {
  // A server that never answers: the request is cut by the signal, and it may have been
  // granted, so the next claim of the job asks with the same key (a slot claim keeps none).
  const seen = [];
  const server = http.createServer((req) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => seen.push({ path: req.url, body: JSON.parse(Buffer.concat(chunks).toString()) }));
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  t.after(() => { server.closeAllConnections(); server.close(); });
  const client = new Client({ server: `http://127.0.0.1:${server.address().port}`, owner: 'cut', ttlMs: 30_000 });
  t.after(() => client.close());
  for (const claim of [
    (signal) => client.claim('cut-job', { signal }),
    (signal) => client.claim('cut-job', { signal, waitMs: 20_000 }),
    (signal) => client.claimSlot('cut-res', 2, { signal }),
    (signal) => client.claimSlot('cut-res', 2, { signal, waitMs: 20_000 }),
  ]) {
    const started = performance.now();
    await assert.rejects(claim(AbortSignal.timeout(200)), (e) => e.name === 'TimeoutError');
    const took = performance.now() - started;
    assert.ok(took >= 190 && took < 600, `rejected after ${took} ms`);
  }
  const keys = seen.map((r) => r.body.lease_key);
  assert.deepEqual(seen.map((r) => r.path.split('?')[0]), ['/v1/leases/cut-job/claim', '/v1/leases/cut-job/claim',
    '/v1/semaphores/cut-res/claim', '/v1/semaphores/cut-res/claim']);
  assert.equal(keys[1], keys[0], 'the key of the cut claim was not kept');
  assert.notEqual(keys[3], keys[2]);
});

test('a slot claim aborted during its backoff rejects at once', async (t) => {
  const s = await stack(t, { proxy: false });
  const holders = [0, 1].map((n) => new Client({ server: s.serverUrl, owner: `holder-${n}`, ttlMs: 30_000 }));
  const f = await front(t, s.serverUrl);
  const waiter = new Client({ server: f.url, owner: 'waiter', ttlMs: 30_000 });
  t.after(() => { holders.forEach((c) => c.close()); waiter.close(); });
  const held = [];
  for (const c of holders) held.push(await c.claimSlot('full', 2));
  // Asked at about 0, 10, 30, 70, 150, 310 and 630 ms, then after 500 ms pauses: an abort at
  // 700 ms falls early in a long pause, which must end at once.
  const controller = new AbortController();
  const reason = new Error('given up');
  const started = performance.now();
  setTimeout(() => controller.abort(reason), 700);
  await assert.rejects(waiter.claimSlot('full', 2, { waitMs: 20_000, signal: controller.signal }), (e) => e === reason);
  const took = performance.now() - started;
  assert.ok(took >= 690 && took < 800, `rejected after ${took} ms`);
  const claims = ofPath(f.seen, '/claim');
  const last = claims.at(-1).at - started;
  assert.ok(claims.length >= 5 && last < 690, `${claims.length} claims, the last at ${last} ms: not in a pause`);
  for (const lease of held) {
    assert.equal((await waiter.status(lease.job)).owner, lease.owner);
    await lease.release();
  }
  await sleep(600); // no claim goes out after the abort
  assert.equal(ofPath(f.seen, '/claim').length, claims.length);
});
