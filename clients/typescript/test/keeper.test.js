// The keeper and waiting claims at the edges: an answer that arrives after the deadline, a
// server that holds waiting claims only briefly.

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import { Client, GrantTooShort, LeaseHeld } from '../src/index.js';
import { Lease } from '../src/lease.js';
import { abortedWithin, sleep, stack } from './helpers.js';

test('a renewal answered after the deadline signals the loss', async (t) => {
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'late', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('late-answer');
  lease._sendRenew = async (timeoutMs) => {
    const answer = await Lease.prototype._sendRenew.call(lease, timeoutMs);
    // The event loop is held up (a long synchronous step) until the deadline has passed.
    const until = lease.deadline + 5;
    while (performance.now() < until) { /* busy */ }
    return answer;
  };
  await abortedWithin(lease.signal, 3000, 'the lease whose renewal was answered too late');
  assert.equal(lease.isLost(), true);
});

test('a waiting claim asks at most every 50 ms whatever the server holds it for', async (t) => {
  const s = await stack(t, { proxy: false, serverArgs: ['--max-claim-wait', '1ms'] });
  const target = new URL(s.serverUrl);
  let claims = 0;
  const counting = http.createServer((req, res) => {
    if (req.url.split('?')[0].endsWith('/claim')) claims += 1;
    const out = http.request({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
      res.writeHead(answer.statusCode, answer.headers);
      answer.pipe(res);
    });
    out.on('error', () => res.destroy());
    req.pipe(out);
  });
  await new Promise((r) => counting.listen(0, '127.0.0.1', r));
  t.after(() => counting.close());
  const holder = new Client({ server: s.serverUrl, owner: 'holder', ttlMs: 10_000 });
  const waiter = new Client({ server: `http://127.0.0.1:${counting.address().port}`, owner: 'waiter' });
  t.after(() => { holder.close(); waiter.close(); });
  const held = await holder.claim('paced');
  await assert.rejects(waiter.claim('paced', { waitMs: 500 }), (e) => e instanceof LeaseHeld);
  await held.release();
  // 500 ms at one claim per 50 ms: about 10 (a loop without a pause sends hundreds).
  assert.ok(claims >= 2 && claims <= 20, `${claims} claims in 500 ms`);
});

test('a grant no longer than the margin is named and given back', async (t) => {
  // 30 s asked, 1 s granted (the server's --max-ttl), 1.5 s margin: no time to hold it.
  const s = await stack(t, { proxy: false, serverArgs: ['--max-ttl', '1s'] });
  const cautious = new Client({ server: s.serverUrl, owner: 'cautious', ttlMs: 30_000, marginMs: 1_500 });
  const next = new Client({ server: s.serverUrl, owner: 'next' });
  t.after(() => { cautious.close(); next.close(); });
  await assert.rejects(cautious.claim('short'), (e) => {
    assert.ok(e instanceof GrantTooShort, String(e));
    assert.deepEqual([e.grantedMs, e.marginMs], [1000, 1500]);
    return true;
  });
  const until = performance.now() + 2000;
  while ((await next.status('short')).state !== 'free') {
    assert.ok(performance.now() < until, 'the short grant was not given back within 2 s');
    await sleep(10);
  }
  const lease = await next.claim('short');
  assert.equal(lease.generation, 2n);
  await lease.release();
});
