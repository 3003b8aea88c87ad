// Fenced semaphores (contract section 15): N slots, each a lease of its own on the job
// `<resource>#<slot>`. Racing claimers, a completed slot (released), another number of slots, a
// stale slot holder, a claim that waits for a slot, and names and sizes refused before sending.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import {
  Client, InvalidJobId, LeaseHeld, LeaseLost, LeaseRefused, LockDelay, ProblemError, SemaphoreSize, ServerUnreachable,
} from '../src/index.js';
import { MAX_RETRY_AFTER, problemError } from '../src/errors.js';
import { Transport, now } from '../src/wire.js';
import { abortedWithin, raw, sleep, stack } from './helpers.js';

/** A whole-keeper pause (GC, SIGSTOP): from now on no renewal reaches the server. */
function pauseRenewals(lease) {
  let resume;
  const resumed = new Promise((r) => { resume = r; });
  lease._sendRenew = async () => {
    await Promise.race([resumed, sleep(30_000)]);
    throw new ServerUnreachable('the worker was paused');
  };
  return resume;
}

test('three racing claimers of two slots', async (t) => {
  const s = await stack(t, { proxy: false });
  const clients = [0, 1, 2].map((n) => new Client({ server: s.serverUrl, owner: `racer-${n}`, ttlMs: 5000 }));
  t.after(() => clients.forEach((c) => c.close()));
  const outcomes = await Promise.allSettled(clients.map((c) => c.claimSlot('res', 2)));
  const leases = outcomes.filter((o) => o.status === 'fulfilled').map((o) => o.value);
  const refused = outcomes.filter((o) => o.status === 'rejected').map((o) => o.reason);
  assert.equal(leases.length, 2, String(refused));
  assert.deepEqual(leases.map((l) => l.job).sort(), ['res#1', 'res#2']);
  for (const lease of leases) {
    assert.deepEqual([lease.resource, lease.job, lease.generation], ['res', `res#${lease.slot}`, 1n]);
    assert.equal(lease.headers()['X-Fencing-Job'], lease.job);
    const record = await clients[0].status(lease.job);
    assert.deepEqual([record.state, record.owner], ['held', lease.owner]);
  }
  assert.equal(refused.length, 1);
  const [e] = refused;
  assert.ok(e instanceof LeaseHeld && !(e instanceof LockDelay), String(e));
  assert.deepEqual([e.status, e.type], [409, 'urn:fence:lease-held']);
  assert.ok(['res#1', 'res#2'].includes(e.problem.job), e.problem.job);
  assert.ok(leases.some((l) => l.owner === e.problem.owner), e.problem.owner);
  assert.ok(e.problem.expires_in_ms > 0 && e.problem.expires_in_ms <= 5000, String(e.problem.expires_in_ms));
  // A plain lease has no resource and no slot; a plain claim of a slot's job is refused.
  const plain = await clients[0].claim('plain-job');
  assert.deepEqual([plain.resource, plain.slot], [undefined, undefined]);
  await plain.release();
  await assert.rejects(clients[0].claim('res#3'),
    (err) => err instanceof ProblemError && err.status === 400 && err.type === 'urn:fence:bad-request');
  for (const lease of leases) assert.equal((await lease.release()).state, 'free');
});

test('completing a slot releases it', async (t) => {
  // complete() on a slot is sent as for any lease; the server frees the slot (state free) and
  // the next claimer gets the same slot job at the next generation. A stale holder's complete
  // is 409 lease-lost.
  const s = await stack(t, { proxy: false });
  const first = new Client({ server: s.serverUrl, owner: 'slot-first', ttlMs: 5000 });
  const second = new Client({ server: s.serverUrl, owner: 'slot-second', ttlMs: 5000 });
  t.after(() => { first.close(); second.close(); });
  const lease = await first.claimSlot('once', 1);
  assert.deepEqual([lease.job, lease.slot, lease.generation], ['once#1', 1, 1n]);
  const record = await lease.complete();
  assert.equal(record.state, 'free');
  assert.equal(lease.isLost(), true);
  assert.equal((await first.status('once#1')).state, 'free');
  const again = await second.claimSlot('once', 1);
  assert.deepEqual([again.job, again.slot, again.generation, again.owner], ['once#1', 1, 2n, 'slot-second']);
  await assert.rejects(lease.complete(), // generation 1 is no longer the holder
    (e) => e instanceof LeaseRefused && e.status === 409 && e.type === 'urn:fence:lease-lost');
  assert.equal((await again.complete()).state, 'free');
});

test('another number of slots while slots are held', async (t) => {
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'sizer', ttlMs: 5000 });
  t.after(() => client.close());
  const first = await client.claimSlot('sized', 2);
  for (const other of [3, 1]) {
    await assert.rejects(client.claimSlot('sized', other), (e) => {
      assert.ok(e instanceof SemaphoreSize && !(e instanceof LeaseHeld), String(e));
      assert.deepEqual([e.status, e.type, e.slots], [409, 'urn:fence:semaphore-size', 2]);
      return true;
    });
  }
  const second = await client.claimSlot('sized', 2); // the number in force is still taken
  assert.deepEqual([first.slot, second.slot].sort(), [1, 2]);
  await first.release();
  await second.release();
  const third = await client.claimSlot('sized', 3); // no slot held: the number may change
  assert.deepEqual([third.job, third.slot], ['sized#1', 1]);
  await third.release();
});

test('a stale slot holder is fenced off', async (t) => {
  const s = await stack(t);
  const ledger = `${s.proxyUrl}/ledger`;
  const a = new Client({ server: s.serverUrl, owner: 'slot-a', ttlMs: 1000, marginMs: 100 });
  const b = new Client({ server: s.serverUrl, owner: 'slot-b', ttlMs: 5000 });
  t.after(() => { a.close(); b.close(); });
  const real = Transport.prototype.call;
  let keyA; // A's lease key, for the stale completion sent raw below
  Transport.prototype.call = function keeping(method, path, body, ...rest) {
    keyA = body?.lease_key;
    return real.call(this, method, path, body, ...rest);
  };
  let leaseA;
  try {
    leaseA = await a.claimSlot('pool', 1);
  } finally {
    Transport.prototype.call = real;
  }
  assert.deepEqual([leaseA.job, leaseA.slot, leaseA.generation], ['pool#1', 1, 1n]);
  await leaseA.saveCheckpoint('half done');
  assert.equal((await leaseA.fetch(ledger, { method: 'POST', body: 'A: write' })).status, 200);
  const lateToken = leaseA.token;
  const resume = pauseRenewals(leaseA); // A stalls: no renewal reaches the server
  t.after(resume);
  await abortedWithin(leaseA.signal, 2000, "A's signal aborts");
  assert.ok(Date.now() < leaseA.expiresAtMs, "before the server's expiry");
  await assert.rejects(leaseA.fetch(ledger, { method: 'POST', body: 'A: late' }), LeaseLost);
  const leaseB = await b.claimSlot('pool', 1, { waitMs: 3000 }); // granted once A's lease expired
  assert.deepEqual([leaseB.job, leaseB.slot, leaseB.generation], ['pool#1', 1, 2n]);
  assert.deepEqual(leaseB.checkpoint, { generation: 1n, data: 'half done' });
  assert.equal((await leaseB.fetch(ledger, { method: 'POST', body: 'B: write' })).status, 200);
  // A's held-up write, sent raw: the proxy refuses the slot's older generation.
  const late = await raw('POST', ledger, { 'X-Fencing-Job': 'pool#1', 'X-Fencing-Token': lateToken }, 'A: late');
  assert.deepEqual([late.status, late.body.type], [409, 'urn:fence:stale-token']);
  // A release or completion (which frees a slot too) by hand of the lease lost here sends
  // nothing: it is left to expire.
  for (const action of ['release', 'complete']) {
    await assert.rejects(leaseA[action](),
      (e) => e instanceof LeaseLost && !(e instanceof LeaseRefused) && /nothing was sent/.test(e.reason));
  }
  // The stale lease's renewal, and its completion sent raw, are refused by the server.
  delete leaseA._sendRenew; // the class's own renewal again
  await assert.rejects(leaseA._sendRenew(1000),
    (e) => e instanceof LeaseRefused && e.type === 'urn:fence:lease-lost' && e.generation === 2n);
  assert.match(keyA, /\S/);
  const stale = await raw('POST', `${s.serverUrl}/v1/leases/pool%231/complete`, { 'content-type': 'application/json' },
    JSON.stringify({ owner: 'slot-a', generation: 1, lease_key: keyA }));
  assert.deepEqual([stale.status, stale.body.type, stale.body.owner, stale.body.generation],
    [409, 'urn:fence:lease-lost', 'slot-b', 2], JSON.stringify(stale.body));
  await assert.rejects(leaseA.saveCheckpoint('stale'), LeaseLost); // lost here already: nothing sent
  assert.equal(leaseB.isLost(), false);
  assert.equal((await leaseB.release()).state, 'free');
  assert.deepEqual(s.upstream.seen.map((w) => [w.job, w.token, w.body]),
    [['pool#1', '1', 'A: write'], ['pool#1', '2', 'B: write']]);
});

test('a waiting claim gets a slot once one is released', async (t) => {
  const s = await stack(t, { proxy: false });
  const holders = [0, 1].map((n) => new Client({ server: s.serverUrl, owner: `holder-${n}`, ttlMs: 5000 }));
  const waiter = new Client({ server: s.serverUrl, owner: 'waiter', ttlMs: 5000 });
  t.after(() => { holders.forEach((c) => c.close()); waiter.close(); });
  const held = [];
  for (const c of holders) held.push(await c.claimSlot('busy', 2));
  // Every slot taken for the whole wait: LeaseHeld once the wait is over, not before.
  let started = performance.now();
  await assert.rejects(waiter.claimSlot('busy', 2, { waitMs: 400 }),
    (e) => e instanceof LeaseHeld && ['busy#1', 'busy#2'].includes(e.problem.job));
  let took = performance.now() - started;
  assert.ok(took >= 400 && took < 1000, String(took));
  started = performance.now();
  const [lease] = await Promise.all([
    waiter.claimSlot('busy', 2, { waitMs: 5000 }),
    sleep(500).then(() => held[1].release()),
  ]);
  took = performance.now() - started;
  assert.ok(took > 400 && took < 1500, String(took)); // polled: got the slot soon after its release
  assert.deepEqual([lease.job, lease.slot, lease.generation], [held[1].job, held[1].slot, 2n]);
  assert.equal((await waiter.status(lease.job)).owner, 'waiter');
  await lease.release();
  await held[0].release();
});

test('bad resource names and numbers of slots are refused before sending', async (t) => {
  const nobody = new Client({ server: 'http://127.0.0.1:9', owner: 'sem' }); // would fail to connect if it sent
  t.after(() => nobody.close());
  for (const resource of ['a#b', '#', 'a b', '', 'x'.repeat(252), 'caf\u00e9']) {
    await assert.rejects(nobody.claimSlot(resource, 2), InvalidJobId, JSON.stringify(resource));
  }
  for (const slots of [0, 1001, -1, 2.5, '2', undefined]) {
    await assert.rejects(nobody.claimSlot('res', slots), RangeError, String(slots));
  }
  for (const slots of [1, 1000]) { // the bounds themselves are sizes: they fail only to connect
    await assert.rejects(nobody.claimSlot('x'.repeat(251), slots), ServerUnreachable);
  }
});

for (const [name, lostAs] of [
  ['unreachable', () => new ServerUnreachable('the answer was lost on its way back')],
  ['503', () => new ProblemError({ type: 'urn:fence:store-unavailable', status: 503,
    detail: 'the store did not confirm the decision within 5 s' }, 503, 0.3)],
  ['502 of a gateway', () => new ProblemError({ type: 'about:blank', status: 502,
    detail: '<html>502 Bad Gateway</html>' }, 502, null)],
]) {
  test(`a lost answer (${name}) to a slot claim gets that slot back, not a second`, async (t) => {
    // The first claim of the resource reaches the server and is decided, but its answer is lost
    // on the way back (a connection cut after the request, a 503 of a store that did not confirm).
    const s = await stack(t, { proxy: false });
    const real = Transport.prototype.call;
    const lost = [];
    const sends = [];
    Transport.prototype.call = async function losing(method, path, body, timeoutMs) {
      const mine = path.includes('/v1/semaphores/lossy') && body?.owner === 'lossy';
      if (mine) sends.push(now());
      const answer = await real.call(this, method, path, body, timeoutMs);
      if (mine && lost.length === 0) {
        lost.push(answer);
        throw lostAs();
      }
      return answer;
    };
    t.after(() => { Transport.prototype.call = real; });
    const client = new Client({ server: s.serverUrl, owner: 'lossy', ttlMs: 5000 });
    const other = new Client({ server: s.serverUrl, owner: 'other', ttlMs: 5000 });
    t.after(() => { client.close(); other.close(); });
    const lease = await client.claimSlot('lossy', 2, { waitMs: 3000 });
    // The retry carried the same key: the slot the lost answer granted, not a second one, so
    // the other slot is still free for someone else.
    assert.deepEqual([lost[0].job, lost[0].generation], [lease.job, lease.generation]);
    const second = await other.claimSlot('lossy', 2);
    assert.notEqual(second.slot, lease.slot);
    // Asked again once, after the 503's Retry-After when there was one.
    const after = lostAs().retryAfter ? lostAs().retryAfter * 1000 : 0;
    assert.ok(sends.length === 2 && sends[1] - sends[0] >= after, `${sends} after ${after}`);
    for (const held of [second, lease]) assert.equal((await held.release()).state, 'free');
    // Without a wait the lost answer is the caller's to handle, as before.
    lost.length = 0;
    await assert.rejects(client.claimSlot('lossy-now', 2), (e) => e.constructor === lostAs().constructor);
  });
}

test('a Retry-After is seconds, at most a minute', () => {
  // A huge one would wait for days (or, past 2^31 ms, fire at once); an HTTP-date, a negative
  // or not-a-number value is none, and backoff decides.
  for (const [value, seconds] of [['2', 2], ['0.3', 0.3], ['99999999999', MAX_RETRY_AFTER],
    ['Infinity', MAX_RETRY_AFTER], ['-1', null], ['NaN', null], ['Wed, 21 Oct 2026 07:28:00 GMT', null]]) {
    assert.equal(problemError(503, 'text/plain', '', value).retryAfter, seconds, value);
  }
});

for (const [name, lostAs] of [
  ['unreachable', () => new ServerUnreachable('the answer was lost on its way back')],
  ['503', () => new ProblemError({ type: 'urn:fence:store-unavailable', status: 503,
    detail: 'the store did not confirm the decision within 5 s' }, 503, null)],
  ['502 of a gateway', () => new ProblemError({ type: 'about:blank', status: 502,
    detail: '<html>502 Bad Gateway</html>' }, 502, null)],
]) {
  test(`a claim after one whose answer was lost (${name}) gets that lease back`, async (t) => {
    // Asked again with a new key, the job would be held (by this owner) for the whole TTL.
    const s = await stack(t, { proxy: false });
    const real = Transport.prototype.call;
    const lost = [];
    Transport.prototype.call = async function losing(method, path, body, timeoutMs) {
      const answer = await real.call(this, method, path, body, timeoutMs);
      if (path.startsWith('/v1/leases/plain-lossy/claim') && lost.length === 0) {
        lost.push(answer);
        throw lostAs();
      }
      return answer;
    };
    t.after(() => { Transport.prototype.call = real; });
    const client = new Client({ server: s.serverUrl, owner: 'lossy', ttlMs: 30_000 });
    t.after(() => client.close());
    await assert.rejects(client.claim('plain-lossy'), (e) => e.constructor === lostAs().constructor);
    const lease = await client.claim('plain-lossy');
    assert.equal(lease.generation, lost[0].generation);
    assert.equal(lease.generation, 1n);
    await lease.release();
    const next = await client.claim('plain-lossy'); // settled: a claim like any other
    assert.equal(next.generation, 2n);
    await next.release();
  });
}
