// A claim answered 200 with a grant that does not follow the contract: the caller gets a
// ProtocolError, and the lease it stands for is not left held, unused, until its TTL ends. A
// grant that names its generation is given back at once (and its key forgotten); one that
// does not keeps its key, which the next claim of the job asks with (so it gets that lease
// back).

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import { Client, ProtocolError } from '../src/index.js';
import { sleep, stack, waitFor } from './helpers.js';

/**
 * A front for the lease server that forwards everything, records each request's path and body,
 * and hands the first 200 of a claim to `mangle` (the parsed answer; the text to answer with).
 */
async function mangling(t, serverUrl, mangle, { refuseRenewals = false } = {}) {
  const target = new URL(serverUrl);
  const seen = [];
  let left = 1;
  let refused = 0;
  const front = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      const body = Buffer.concat(chunks).toString();
      seen.push({ path: req.url, body: body ? JSON.parse(body) : undefined });
      if (refuseRenewals && req.url.endsWith('/renew')) {
        // The first renewal is refused; the later ones get no answer (their connection is
        // cut), and a failure with no answer must not hide the 401 before it.
        refused += 1;
        if (refused > 1) {
          req.socket.destroy();
          return;
        }
        const problem = JSON.stringify({ type: 'urn:fence:unauthenticated', status: 401, detail: 'the front knows no such secret' });
        res.writeHead(401, { 'content-type': 'application/problem+json', 'content-length': Buffer.byteLength(problem) });
        res.end(problem);
        return;
      }
      const out = http.request({ host: target.hostname, port: target.port, method: req.method, path: req.url, headers: req.headers }, (answer) => {
        const got = [];
        answer.on('data', (c) => got.push(c));
        answer.on('end', () => {
          let text = Buffer.concat(got).toString();
          if (answer.statusCode === 200 && req.url.split('?')[0].endsWith('/claim') && left > 0) {
            left -= 1;
            text = mangle(JSON.parse(text));
          }
          res.writeHead(answer.statusCode, { 'content-type': answer.headers['content-type'], 'content-length': Buffer.byteLength(text) });
          res.end(text);
        });
      });
      out.on('error', () => res.destroy());
      out.end(body);
    });
  });
  await new Promise((r) => front.listen(0, '127.0.0.1', r));
  t.after(() => { front.closeAllConnections(); front.close(); });
  return { url: `http://127.0.0.1:${front.address().port}`, seen };
}

/** Resolves once the server records `job` as free; fails after `withinMs`. */
async function freeWithin(client, job, withinMs) {
  const until = performance.now() + withinMs;
  let state;
  while ((state = (await client.status(job)).state) !== 'free') {
    assert.ok(performance.now() < until, `${job} is still ${state} after ${withinMs} ms: not given back`);
    await sleep(10);
  }
}

const NAMED = {
  'without ttl_ms': (a) => { delete a.ttl_ms; return JSON.stringify(a); },
  'ttl_ms 0': (a) => JSON.stringify({ ...a, ttl_ms: 0 }),
  'ttl_ms 1.5': (a) => JSON.stringify({ ...a, ttl_ms: 1.5 }),
  'a token of another generation': (a) => JSON.stringify({ ...a, token: '99.1.x' }),
  'expires_at_ms -1': (a) => JSON.stringify({ ...a, expires_at_ms: -1 }),
  // Outside what a server grants (0.1 s to 24 h), and an expiry no u64 holds: refused by the
  // Rust client, taken before.
  'ttl_ms 99': (a) => JSON.stringify({ ...a, ttl_ms: 99 }),
  'ttl_ms 86400001': (a) => JSON.stringify({ ...a, ttl_ms: 86_400_001 }),
  'expires_at_ms 2^64': (a) => JSON.stringify(a).replace(/"expires_at_ms":\d+/, '"expires_at_ms":18446744073709551616'),
  // A checkpoint that is not {generation: u64, data: text} was handed to the worker as is.
  'checkpoint text': (a) => JSON.stringify({ ...a, checkpoint: 'rows 0-999' }),
  'checkpoint without data': (a) => JSON.stringify({ ...a, checkpoint: { generation: 1 } }),
  'checkpoint without a generation': (a) => JSON.stringify({ ...a, checkpoint: { data: 'rows' } }),
  'checkpoint data 5': (a) => JSON.stringify({ ...a, checkpoint: { generation: 1, data: 5 } }),
  'checkpoint generation -1': (a) => JSON.stringify({ ...a, checkpoint: { generation: -1, data: 'rows' } }),
  'checkpoint generation true': (a) => JSON.stringify({ ...a, checkpoint: { generation: true, data: 'rows' } }),
};

test('a malformed grant that names its generation is given back at once', async (t) => {
  const s = await stack(t, { proxy: false });
  const observer = new Client({ server: s.serverUrl, owner: 'observer' });
  t.after(() => observer.close());
  let n = 0;
  for (const [what, mangle] of Object.entries(NAMED)) {
    n += 1;
    const job = `malformed-${n}`;
    const front = await mangling(t, s.serverUrl, mangle);
    const client = new Client({ server: front.url, owner: 'worker', ttlMs: 30_000 });
    t.after(() => client.close());
    await assert.rejects(client.claim(job), (e) => {
      assert.ok(e instanceof ProtocolError, `${what}: ${e}`);
      assert.match(e.message, /given back/, what);
      return true;
    });
    // The release names the grant: the claim's owner and key, the answer's generation.
    const claim = front.seen.find((r) => r.path.endsWith('/claim'));
    await waitFor(`${what}: a release`, 5000, () => front.seen.some((r) => r.path.endsWith('/release')));
    const release = front.seen.find((r) => r.path.endsWith('/release'));
    assert.equal(release.path, `/v1/leases/${job}/release`, what);
    assert.deepEqual(release.body, { owner: 'worker', generation: 1, lease_key: claim.body.lease_key }, what);
    await freeWithin(observer, job, 5000);
    // Its key is not kept: asked again with it before the release landed, the claim would get
    // the grant back and the release would then free the job under its new holder.
    const again = await client.claim(job);
    const claims = front.seen.filter((r) => r.path.endsWith('/claim'));
    assert.equal(claims.length, 2, what);
    assert.notEqual(claims[1].body.lease_key, claims[0].body.lease_key, `${what}: the given-back key was kept`);
    assert.equal(again.generation, 2n, what);
    await again.release();
  }
});

test('a malformed grant without a generation keeps its key for the next claim', async (t) => {
  const s = await stack(t, { proxy: false });
  for (const [what, mangle] of Object.entries({
    'without a generation': (a) => { delete a.generation; return JSON.stringify(a); },
    'generation 0': (a) => JSON.stringify({ ...a, generation: 0 }),
    'generation -1': (a) => JSON.stringify({ ...a, generation: -1 }),
    'not JSON': () => '{"job": ',
  })) {
    const job = `nameless-${what.replace(/\W+/g, '-')}`;
    const front = await mangling(t, s.serverUrl, mangle);
    const client = new Client({ server: front.url, owner: 'worker', ttlMs: 30_000 });
    t.after(() => client.close());
    await assert.rejects(client.claim(job), (e) => {
      assert.ok(e instanceof ProtocolError, `${what}: ${e}`);
      assert.match(e.message, /held until its TTL ends/, what);
      return true;
    });
    assert.ok(!front.seen.some((r) => r.path.endsWith('/release')), `${what}: a release without a generation`);
    // Asked with the same key, the server gives that very lease back (another key: 409 held).
    const lease = await client.claim(job);
    const claims = front.seen.filter((r) => r.path.endsWith('/claim'));
    assert.equal(claims.length, 2, what);
    assert.equal(claims[1].body.lease_key, claims[0].body.lease_key, what);
    assert.equal(lease.generation, 1n, what);
    await lease.release();
  }
});

test('a malformed grant of a semaphore slot is given back', async (t) => {
  const s = await stack(t, { proxy: false });
  const front = await mangling(t, s.serverUrl, (a) => JSON.stringify({ ...a, ttl_ms: -5 }));
  const client = new Client({ server: front.url, owner: 'worker', ttlMs: 30_000 });
  const observer = new Client({ server: s.serverUrl, owner: 'observer' });
  t.after(() => { client.close(); observer.close(); });
  await assert.rejects(client.claimSlot('exports', 2), (e) => e instanceof ProtocolError && /given back/.test(e.message));
  await waitFor('a release of the slot', 5000, () => front.seen.some((r) => r.path === '/v1/leases/exports%231/release'));
  const claim = front.seen.find((r) => r.path.endsWith('/claim'));
  const release = front.seen.find((r) => r.path.endsWith('/release'));
  assert.deepEqual(release.body, { owner: 'worker', generation: 1, lease_key: claim.body.lease_key });
  await freeWithin(observer, 'exports#1', 5000);
});

test('a loss at the deadline says why the renewals failed', async (t) => {
  // A renewal answered 401 (a rotated secret) is retried until the deadline; the loss's
  // reason then names the 401, not the later attempts that got no answer.
  const s = await stack(t, { proxy: false });
  const front = await mangling(t, s.serverUrl, (a) => JSON.stringify(a), { refuseRenewals: true });
  const client = new Client({ server: front.url, ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('renewals-refused');
  await waitFor('the lease lost', 5000, () => lease.isLost());
  assert.match(lease.lossReason, /^the local deadline passed before a renewal succeeded \(the last renewal failed: .*no such secret/);
  assert.ok(front.seen.some((r) => r.path.endsWith('/renew')));
});
