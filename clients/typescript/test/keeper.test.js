// The keeper and waiting claims at the edges: an answer that arrives after the deadline, a
// server that holds waiting claims only briefly.

import assert from 'node:assert/strict';
import { getEventListeners } from 'node:events';
import http from 'node:http';
import { test } from 'node:test';

import { Client, GrantTooShort, LeaseHeld, LeaseLost, fencedFetch } from '../src/index.js';
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

// A front for the lease server whose next `failures` releases or completions fail as if the
// server never answered: forwarded first (their answer lost) when `applied`, not otherwise.
async function flakyFront(t, serverUrl, failures, applied) {
  const target = new URL(serverUrl);
  const seen = { finishes: 0 };
  const front = http.createServer((req, res) => {
    const finishing = /\/(release|complete)$/.test(req.url.split('?')[0]);
    if (finishing) seen.finishes += 1;
    const failing = finishing && seen.finishes <= failures;
    if (failing && !applied) {
      req.resume();
      req.on('end', () => res.destroy());
      return;
    }
    const out = http.request({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
      if (failing) {
        answer.resume();
        answer.on('end', () => res.destroy());
        return;
      }
      res.writeHead(answer.statusCode, answer.headers);
      answer.pipe(res);
    });
    out.on('error', () => res.destroy());
    req.pipe(out);
  });
  await new Promise((r) => front.listen(0, '127.0.0.1', r));
  t.after(() => front.close());
  return { url: `http://127.0.0.1:${front.address().port}`, seen };
}

test('a completion whose answer was lost is done, not lost', async (t) => {
  const s = await stack(t, { proxy: false });
  const front = await flakyFront(t, s.serverUrl, 1, true);
  const client = new Client({ server: front.url, owner: 'finisher', ttlMs: 30_000 });
  const direct = new Client({ server: s.serverUrl });
  t.after(() => { client.close(); direct.close(); });
  const lease = await client.claim('report');
  const record = await lease.complete();
  assert.deepEqual([record.state, record.owner, front.seen.finishes], ['completed', 'finisher', 2]);
  assert.equal((await direct.status('report')).state, 'completed');
});

test('a release that never reached the server is sent again', async (t) => {
  const s = await stack(t, { proxy: false });
  const front = await flakyFront(t, s.serverUrl, 2, false);
  const client = new Client({ server: front.url, owner: 'finisher', ttlMs: 30_000 });
  const direct = new Client({ server: s.serverUrl });
  t.after(() => { client.close(); direct.close(); });
  const lease = await client.claim('blip');
  const record = await lease.release();
  assert.deepEqual([record.state, front.seen.finishes], ['free', 3]);
  assert.equal((await direct.status('blip')).state, 'free');
});

test('a server that keeps failing a release is given up on at the lease\'s end', async (t) => {
  const s = await stack(t, { proxy: false });
  const front = await flakyFront(t, s.serverUrl, 1_000, false);
  const client = new Client({ server: front.url, owner: 'finisher', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('down');
  const started = performance.now();
  await assert.rejects(lease.release(), (e) => e.name === 'ServerUnreachable' || e.constructor.name === 'ServerUnreachable');
  const took = performance.now() - started;
  assert.ok(took > 500 && took < 1500, `gave up after ${took} ms (the lease ends 1 s after its claim)`);
  assert.ok(front.seen.finishes > 2, `${front.seen.finishes} attempts`);
});

test('fencedFetch checks the lease again before following a redirect', async (t) => {
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'redirected', ttlMs: 5000 });
  t.after(() => client.close());
  const reached = [];
  let lose = null;
  const destination = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      if (req.url === '/slow') {
        if (lose) lose(); // lost while the destination took its time
        res.writeHead(307, { location: '/target', 'content-length': '0' });
      } else {
        reached.push([req.method, req.headers['x-fencing-token'], req.headers.authorization]);
        res.writeHead(200, { 'content-length': '0' });
      }
      res.end();
    });
  });
  await new Promise((r) => destination.listen(0, '127.0.0.1', r));
  t.after(() => destination.close());
  const url = `http://127.0.0.1:${destination.address().port}/slow`;

  // Held: the redirect is followed, the POST and its body kept (307), the token stamped.
  const lease = await client.claim('redirected');
  const ok = await fencedFetch(lease)(url, { method: 'POST', body: 'x' });
  assert.equal(ok.status, 200);
  assert.deepEqual(reached, [['POST', lease.token, undefined]]);

  // Lost while the first hop was answered: the redirect is not followed.
  reached.length = 0;
  lose = () => lease.abandon();
  await assert.rejects(fencedFetch(lease)(url, { method: 'POST', body: 'x' }), (e) => e instanceof LeaseLost);
  assert.deepEqual(reached, [], 'the redirect was followed with the lost lease\'s token');
});

test('fencedFetch aborts a request still waiting for its answer when the lease is lost, not a body being read', { timeout: 20000 }, async (t) => {
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'in-flight', ttlMs: 5000 });
  t.after(() => client.close());
  const held = [];
  const destination = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => {
      if (req.url === '/hold') {
        held.push(res); // answered only when the test ends
        return;
      }
      // The head at once, the body 300 ms later.
      res.writeHead(200, { 'content-length': '4' });
      res.flushHeaders();
      setTimeout(() => res.end('done'), 300);
    });
  });
  await new Promise((r) => destination.listen(0, '127.0.0.1', r));
  t.after(() => {
    for (const res of held) res.destroy();
    destination.closeAllConnections();
    destination.close();
  });
  const base = `http://127.0.0.1:${destination.address().port}`;

  // Lost while the destination holds the answer: rejected with the LeaseLost at once.
  const waiting = await client.claim('in-flight-1');
  const started = performance.now();
  const pending = waiting.fetch(`${base}/hold`, { method: 'POST', body: 'x' });
  while (held.length === 0) await sleep(10);
  waiting.abandon();
  await assert.rejects(pending, (e) => e instanceof LeaseLost && e.inFlight === true && /may have reached/.test(e.message));
  assert.ok(performance.now() - started < 2000, 'the request outlived its lease');
  // Asked after the loss: refused before sending, not in flight.
  await assert.rejects(waiting.fetch(`${base}/body`, { method: 'POST', body: 'x' }), (e) => e instanceof LeaseLost && e.inFlight === false);

  // Lost after the answer's head arrived: its body is still read whole.
  const answered = await client.claim('in-flight-2');
  const response = await answered.fetch(`${base}/body`, { method: 'POST', body: 'x' });
  answered.abandon();
  assert.equal(await response.text(), 'done');

  // The caller's own signal still aborts it.
  const own = await client.claim('in-flight-3');
  const mine = new AbortController();
  const cancelled = own.fetch(`${base}/hold`, { method: 'POST', body: 'x', signal: mine.signal });
  while (held.length < 2) await sleep(10);
  mine.abort(new Error('mine'));
  await assert.rejects(cancelled, (e) => e.message === 'mine');
  assert.equal(own.isLost(), false);
  // A long-lived signal of the caller's, passed to many fetches, keeps no listener of each.
  const lasting = new AbortController();
  for (let i = 0; i < 20; i += 1) {
    const r = await own.fetch(`${base}/body`, { method: 'POST', body: 'x', signal: lasting.signal });
    assert.equal(await r.text(), 'done');
  }
  assert.ok(getEventListeners(lasting.signal, 'abort').length <= 1,
    `${getEventListeners(lasting.signal, 'abort').length} listeners left on the caller's signal`);
  await own.release();
});

test('a release cancels the renewal under way: no timer outlives the lease', async (t) => {
  const s = await stack(t, { proxy: false });
  const target = new URL(s.serverUrl);
  let renewing = 0;
  const hung = [];
  // Forwards everything but renewals, which it holds without an answer.
  const front = http.createServer((req, res) => {
    if (req.url.endsWith('/renew')) {
      renewing += 1;
      hung.push(res);
      return;
    }
    const out = http.request({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
      res.writeHead(answer.statusCode, answer.headers);
      answer.pipe(res);
    });
    out.on('error', () => res.destroy());
    req.pipe(out);
  });
  await new Promise((r) => front.listen(0, '127.0.0.1', r));
  t.after(() => { hung.forEach((r) => r.destroy()); front.close(); });
  const client = new Client({ server: `http://127.0.0.1:${front.address().port}`, owner: 'quitter', ttlMs: 6_000 });
  t.after(() => client.close());
  const timers = () => process.getActiveResourcesInfo().filter((r) => r === 'Timeout').length;
  const before = timers();
  const lease = await client.claim('quits-mid-renewal');
  // The keeper's first renewal goes out after a third of the TTL, 2 s.
  const until = performance.now() + 15_000;
  while (renewing === 0) {
    assert.ok(performance.now() < until, 'no renewal was sent within 15 s');
    await sleep(50);
  }
  await lease.release();
  await sleep(50);
  // Before: the renewal's own timer and the keeper's race against the deadline stayed until
  // the lease's deadline, some 3 s on, keeping a process that had finished alive.
  assert.equal(timers(), before, `timers left: ${process.getActiveResourcesInfo()}`);
});
