// Job ids that need percent-encoding round-trip through claim, status, the proxy and a revoke
// (whose refused renewal must abort the signal); ids outside visible ASCII never leave. A '#' is
// a semaphore slot's (`<resource>#<slot>`): the slot of resource `a?b` is one of the ids.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { Client, InvalidJobId, LeaseLost, encodeJob } from '../src/index.js';
import { abortedWithin, raw, stack } from './helpers.js';

// `.` and `..` too: a WHATWG URL (fetch) would resolve them away as dot segments.
const IDS = ['a/b', 'a%b', 'a?b', 'a+b', 'a%2Fb', '..', '.', '~x_y-z.', '"\'\\<>{}|^`!$&()*,;=:@['];

test('job ids round-trip', { timeout: 60_000 }, async (t) => {
  const s = await stack(t);
  const client = new Client({ server: s.serverUrl, owner: 'ids', ttlMs: 1000 });
  t.after(() => client.close());
  const leases = [];
  const jobs = [...IDS, 'a?b#1'];
  for (const job of jobs) {
    const lease = job.includes('#') ? await client.claimSlot('a?b', 1) : await client.claim(job);
    leases.push(lease);
    assert.equal(lease.job, job);
    assert.equal(lease.generation, 1n);
    assert.equal((await client.status(job)).job, job);
    const viaRaw = await raw('GET', `${s.serverUrl}/v1/leases/${encodeJob(job)}`);
    assert.deepEqual([viaRaw.status, viaRaw.body.job, viaRaw.body.state], [200, job, 'held']);
    const r = await lease.fetch(`${s.proxyUrl}/w`, { method: 'POST', body: job });
    assert.equal(r.status, 200, await r.text());
  }
  assert.deepEqual(s.upstream.seen.map((w) => [w.job, w.body]), jobs.map((j) => [j, j]));
  // An operator takes each lease away: the next renewal is refused, and the lease is lost.
  for (const job of jobs) {
    const revoked = await raw('POST', `${s.serverUrl}/v1/leases/${encodeJob(job)}/revoke`);
    assert.deepEqual([revoked.status, revoked.body.job, revoked.body.generation], [200, job, 2]);
  }
  for (const lease of leases) {
    await abortedWithin(lease.signal, 2000, `${lease.job}: the refused renewal aborts the signal`);
    assert.match(lease.lossReason, /urn:fence:lease-lost/);
    await assert.rejects(lease.fetch(`${s.proxyUrl}/w`, { method: 'POST', body: 'late' }), LeaseLost);
  }
  assert.equal(s.upstream.seen.length, jobs.length);
});

test('the encoding is exactly the unreserved set', () => {
  assert.equal(encodeJob('a/b'), 'a%2Fb');
  assert.equal(encodeJob('a%b'), 'a%25b');
  assert.equal(encodeJob('a?b#c'), 'a%3Fb%23c');
  assert.equal(encodeJob('a+b'), 'a%2Bb');
  assert.equal(encodeJob('Az09-._~'), 'Az09-._~');
});

test('invalid job ids are refused before sending', async () => {
  const nobody = new Client({ server: 'http://127.0.0.1:9', owner: 'ids' }); // would fail to connect if it sent
  for (const job of ['a b', '', 'x'.repeat(257), 'caf\u00e9', 'tab\there', '\x7f']) {
    await assert.rejects(nobody.claim(job), InvalidJobId, JSON.stringify(job));
    await assert.rejects(nobody.status(job), InvalidJobId);
  }
});
