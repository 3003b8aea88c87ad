// Auth, TLS, waiting claims, refusals as errors, derived idempotency keys.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { chmodSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { join } from 'node:path';
import { test } from 'node:test';

import { Client, JobCompleted, LeaseHeld, LeaseLost, LeaseRefused, LockDelay, ProblemError, ServerUnreachable, idempotencyKey } from '../src/index.js';
import { Transport, now } from '../src/wire.js';
import { abortedWithin, fenceBin, raw, sleep, stack } from './helpers.js';

const SECRET = 's3cret-s3cret-s3cret';

test('bearer token and CA file', async (t) => {
  const s0 = await stack(t, { proxy: false }); // only for its temporary directory
  const cert = join(s0.dir, 'cert.pem');
  const key = join(s0.dir, 'key.pem');
  execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes',
    '-keyout', key, '-out', cert, '-days', '1', '-subj', '/CN=127.0.0.1', '-addext', 'subjectAltName=IP:127.0.0.1'], { stdio: 'ignore' });
  const auth = join(s0.dir, 'auth');
  writeFileSync(auth, `workers ${SECRET} tls-*\n`);
  chmodSync(auth, 0o600);
  const tokenFile = join(s0.dir, 'token');
  writeFileSync(tokenFile, `  ${SECRET}\n`);
  const s = await stack(t, { proxy: false, scheme: 'https', serverArgs: ['--tls-cert', cert, '--tls-key', key, '--auth-file', auth] });
  const saved = { token: process.env.FENCE_AUTH_TOKEN, ca: process.env.FENCE_CA_CERT };
  t.after(() => {
    for (const [name, value] of [['FENCE_AUTH_TOKEN', saved.token], ['FENCE_CA_CERT', saved.ca]]) {
      if (value === undefined) delete process.env[name]; else process.env[name] = value;
    }
  });
  delete process.env.FENCE_AUTH_TOKEN;
  delete process.env.FENCE_CA_CERT;

  const clients = [];
  const make = (options) => { const c = new Client({ server: s.serverUrl, ...options }); clients.push(c); return c; };
  t.after(() => clients.forEach((c) => c.close()));
  await make({ authToken: SECRET, caFile: cert, ttlMs: 1000 }).run('tls-1', async (l) => assert.equal(l.generation, 1n));
  await make({ authTokenFile: tokenFile, caFile: cert }).run('tls-2', async () => {});
  process.env.FENCE_AUTH_TOKEN = `${SECRET}\n`; // a Kubernetes secret's newline is no part of it
  process.env.FENCE_CA_CERT = cert;
  await make({}).run('tls-3', async () => {});
  assert.equal((await make({}).status('tls-3')).state, 'completed');
  await assert.rejects(make({}).claim('other-job'), (e) => e instanceof ProblemError && e.status === 403 && e.type === 'urn:fence:forbidden');
  delete process.env.FENCE_AUTH_TOKEN;
  // One a header cannot carry is refused at once, and never repeated in the error.
  for (const bad of [`${SECRET}\x01`, `${SECRET.slice(0, 8)} ${SECRET.slice(8)}`]) {
    assert.throws(() => make({ authToken: bad }),
      (e) => e instanceof TypeError && e.message.includes('authToken') && !e.message.includes(SECRET.slice(0, 8)));
  }
  await assert.rejects(make({ caFile: cert }).claim('tls-4'),
    (e) => e instanceof ProblemError && e.status === 401 && e.type === 'urn:fence:unauthenticated');
  delete process.env.FENCE_CA_CERT;
  await assert.rejects(make({ authToken: SECRET }).claim('tls-5'), // the system roots do not know it
    (e) => e instanceof ServerUnreachable && /self.signed|certificate/i.test(e.message));
});

test('waiting claim and refusals', async (t) => {
  const s = await stack(t, { proxy: false });
  const holder = new Client({ server: s.serverUrl, owner: 'holder', ttlMs: 1000 });
  const waiter = new Client({ server: s.serverUrl, owner: 'waiter', ttlMs: 1500 });
  t.after(() => { holder.close(); waiter.close(); });
  (await holder.claim('wait-job')).abandon(); // stops renewing: it runs out in about a second
  await assert.rejects(waiter.claim('wait-job'), (e) => {
    assert.ok(e instanceof LeaseHeld);
    assert.deepEqual([e.status, e.type, e.problem.owner], [409, 'urn:fence:lease-held', 'holder']);
    assert.ok(e.problem.expires_in_ms > 0 && e.problem.expires_in_ms <= 1000);
    return true;
  });
  const started = performance.now();
  const lease = await waiter.claim('wait-job', { waitMs: 5000 });
  const took = performance.now() - started;
  assert.ok(lease.generation === 2n && took > 500 && took < 2000, String(took));
  // It waited most of a second of its 1.35 s of usable time: renewed at once, so the deadline
  // counts from that renewal, not from the claim sent a second ago.
  assert.ok(lease.deadline - performance.now() > 900, String(lease.deadline - performance.now()));
  await lease.complete();
  await assert.rejects(waiter.claim('wait-job', { waitMs: 1000 }),
    (e) => e instanceof JobCompleted && e.status === 410 && e.problem.generation === 2n);
  await assert.rejects(waiter.status('never-claimed'),
    (e) => e instanceof ProblemError && e.status === 404 && e.type === 'urn:fence:unknown-job');
});

test('lock-delay keeps an expired job, and a waiting claim waits it out', async (t) => {
  const s = await stack(t, { proxy: false });
  const stalled = new Client({ server: s.serverUrl, owner: 'stalled', ttlMs: 1000, lockDelayMs: 2000 });
  const next = new Client({ server: s.serverUrl, owner: 'next', ttlMs: 5000 });
  t.after(() => { stalled.close(); next.close(); });
  (await stalled.claim('delayed')).abandon(); // expires in about a second; its 2 s delay follows
  await sleep(1200);
  await assert.rejects(next.claim('delayed'), (e) => {
    assert.ok(e instanceof LockDelay && e instanceof LeaseHeld);
    assert.deepEqual([e.status, e.type, e.problem.owner, e.problem.generation], [409, 'urn:fence:lock-delay', 'stalled', 1n]);
    assert.ok(e.problem.claimable_in_ms >= 1000 && e.problem.claimable_in_ms <= 2000, String(e.problem.claimable_in_ms));
    assert.ok(e.retryAfter === 1 || e.retryAfter === 2, String(e.retryAfter));
    return true;
  });
  const started = performance.now();
  const lease = await next.claim('delayed', { waitMs: 5000 });
  assert.ok(lease.generation === 2n && performance.now() - started > 800);
  await lease.release();
  // A claim's own lock-delay beats the client's; 0 means none.
  (await stalled.claim('own-zero', { lockDelayMs: 0 })).abandon();
  await sleep(1200);
  await (await next.claim('own-zero')).release();
  assert.throws(() => new Client({ server: s.serverUrl, lockDelayMs: -1 }), RangeError);
});

/** How many releases and completions reached the server (any answer), from its /metrics. */
async function finishesAnswered(serverUrl) {
  const { status, body } = await raw('GET', `${serverUrl}/metrics`);
  assert.ok(status === 200 && body.includes('fence_lease_requests_total'), String(body));
  return body.split('\n')
    .filter((l) => l.startsWith('fence_lease_requests_total{') && /op="(release|complete)"/.test(l))
    .reduce((sum, l) => sum + Number(l.slice(l.lastIndexOf(' ') + 1)), 0);
}

// A's lease on `job` (owner 'a') was neither released nor completed: b's claim is refused (held
// while the lease runs, then its lock-delay, never granted), and the server answered no release
// or completion at all.
async function assertLeftToExpire(serverUrl, b, job) {
  await assert.rejects(b.claim(job), (e) => {
    assert.ok(e instanceof LeaseHeld, String(e));
    assert.ok(['urn:fence:lease-held', 'urn:fence:lock-delay'].includes(e.type), e.type);
    assert.equal(e.problem.owner, 'a');
    return true;
  });
  assert.ok(['held', 'expired'].includes((await b.status(job)).state), job);
  assert.equal(await finishesAnswered(serverUrl), 0, job);
}

test('a lease abandoned inside run is neither released nor completed', async (t) => {
  // Seen against `fence server --lock-delay 30s`: a callback that abandoned its lease after a
  // write that may still land (a timeout, a 504), then threw, had the lease released by run,
  // so the next claim was granted at once and the lock-delay never applied.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 10_000 });
  const b = new Client({ server: s.serverUrl, owner: 'b', ttlMs: 10_000 });
  t.after(() => { a.close(); b.close(); });
  const leftToExpire = (job) => assertLeftToExpire(s.serverUrl, b, job);
  const timedOut = new Error('the write may still land');
  await assert.rejects(a.run('throws', async (lease) => { lease.abandon(); throw timedOut; }), (e) => e === timedOut);
  await leftToExpire('throws');
  // A callback that resolves after abandoning: no completion, and no LeaseLost.
  assert.equal(await a.run('resolves', async (lease) => { lease.abandon(); return 7; }), 7);
  await leftToExpire('resolves');
  await a.run('resolves-release', async (lease) => { lease.abandon(); }, { onSuccess: 'release' });
  await leftToExpire('resolves-release');
  await (await a.claim('counted')).release(); // the count sees one when there is one
  assert.equal(await finishesAnswered(s.serverUrl), 1);
});

test('a release or completion by hand after abandon sends nothing', async (t) => {
  // A `finally { await lease.release(); }` written before the abandon of a write that may still
  // land sent the release: the next claim was granted at once, skipping the lock-delay.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 10_000 });
  const b = new Client({ server: s.serverUrl, owner: 'b', ttlMs: 10_000 });
  t.after(() => { a.close(); b.close(); });
  const refusedUnsent = (job) => (e) => {
    assert.ok(e instanceof LeaseLost && !(e instanceof LeaseRefused), String(e)); // not the server's
    assert.equal(e.job, job);
    assert.match(e.reason, /abandoned/);
    assert.match(e.reason, /lock-delay/);
    assert.match(e.reason, /nothing was sent/);
    assert.equal(e.inFlight, false);
    return true;
  };
  for (const action of ['release', 'complete']) {
    const job = `by-hand-${action}`;
    const lease = await a.claim(job);
    const timedOut = new Error('the write may still land');
    await assert.rejects((async () => {
      try {
        lease.abandon();
        throw timedOut;
      } catch {
        lease.abandon(); // idempotent
      } finally {
        await lease[action]();
      }
    })(), refusedUnsent(job));
    await assert.rejects(lease[action](), refusedUnsent(job)); // asked again: still nothing sent
    await assertLeftToExpire(s.serverUrl, b, job);
  }
  // Abandon after a release changes nothing: the release was sent, and is not undone.
  const released = await a.claim('released-then-abandoned');
  await released.release();
  released.abandon();
  assert.equal(await finishesAnswered(s.serverUrl), 1);
  assert.equal((await a.status('released-then-abandoned')).state, 'free');
});

/** From now on every renewal of `lease` fails unanswered: it is lost at its deadline. */
function failRenewals(lease) {
  lease._sendRenew = async () => { throw new ServerUnreachable('the server is out of reach (the test)'); };
}

/** A destination that takes each request and never answers: a write on its way at the loss. */
async function startSilent(t) {
  let reached = 0;
  const server = http.createServer(() => { reached += 1; });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  t.after(() => { server.closeAllConnections(); server.close(); });
  return { url: `http://127.0.0.1:${server.address().port}/ledger`, reached: () => reached };
}

test('a lease lost inside run is neither released nor completed', async (t) => {
  // Seen against `fence server --lock-delay 30s`: the keeper declared the lease lost (no
  // progress) while a write to an unfenced upstream was on its way; lease.fetch rejected with
  // LeaseLost (inFlight), run released the lease, the server took the release (nobody had
  // claimed since), and the next claim was granted at once while the write committed later.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const stalls = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000, progressWithinMs: 300 });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000 });
  const b = new Client({ server: s.serverUrl, owner: 'b', ttlMs: 10_000 });
  t.after(() => { stalls.close(); a.close(); b.close(); });
  const silent = await startSilent(t);
  await assert.rejects(stalls.run('in-flight', async (lease) => {
    await lease.fetch(silent.url, { method: 'POST', body: 'charge' }); // cut by the loss
  }), (e) => {
    assert.ok(e instanceof LeaseLost && e.inFlight && /no progress/.test(e.reason), String(e));
    return true;
  });
  assert.equal(silent.reached(), 1);
  await assertLeftToExpire(s.serverUrl, b, 'in-flight');
  // fn resolves after the loss: LeaseLost, nothing sent (onSuccess 'release' too).
  for (const onSuccess of ['complete', 'release']) {
    const job = `no-progress-${onSuccess}`;
    await assert.rejects(stalls.run(job, async (lease) => {
      await abortedWithin(lease.signal, 10_000, 'no progress reported, still held');
    }, { onSuccess }), (e) => {
      assert.ok(e instanceof LeaseLost && !(e instanceof LeaseRefused) && /no progress/.test(e.reason), String(e));
      return true;
    });
    await assertLeftToExpire(s.serverUrl, b, job);
  }
  // The local deadline (renewals unanswered), and fn throws its own error: that error.
  const timedOut = new Error('the write cut by the loss may still land');
  await assert.rejects(a.run('deadline-throws', async (lease) => {
    failRenewals(lease);
    await abortedWithin(lease.signal, 10_000, 'renewals fail, still held');
    assert.match(lease.lossReason, /local deadline passed/);
    throw timedOut;
  }), (e) => e === timedOut);
  await assertLeftToExpire(s.serverUrl, b, 'deadline-throws');
});

test('a release by hand after a local loss sends nothing', async (t) => {
  // A `finally { await lease.release(); }` after the keeper declared the lease lost sent the
  // release, which the server took (nobody had claimed since): the lock-delay was skipped.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const stalls = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000, progressWithinMs: 300 });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000 });
  const b = new Client({ server: s.serverUrl, owner: 'b', ttlMs: 10_000 });
  t.after(() => { stalls.close(); a.close(); b.close(); });
  const refusedUnsent = (job, why) => (e) => {
    assert.ok(e instanceof LeaseLost && !(e instanceof LeaseRefused), String(e)); // not the server's
    assert.equal(e.job, job);
    assert.match(e.reason, why);
    assert.match(e.reason, /left to expire/);
    assert.match(e.reason, /lock-delay/);
    assert.match(e.reason, /nothing was sent/);
    assert.equal(e.inFlight, false);
    return true;
  };
  let lease = await stalls.claim('no-progress');
  await abortedWithin(lease.signal, 10_000, 'no progress reported, still held');
  await assert.rejects(lease.release(), refusedUnsent('no-progress', /no progress/));
  await assert.rejects(lease.release(), refusedUnsent('no-progress', /no progress/)); // again: nothing sent
  await assertLeftToExpire(s.serverUrl, b, 'no-progress');
  lease = await a.claim('deadline');
  failRenewals(lease);
  await abortedWithin(lease.signal, 10_000, 'renewals fail, still held');
  await assert.rejects(lease.release(), refusedUnsent('deadline', /local deadline passed/));
  await assertLeftToExpire(s.serverUrl, b, 'deadline');
  // A semaphore slot's lease: the same.
  const slot = await stalls.claimSlot('pool', 1);
  await abortedWithin(slot.signal, 10_000, 'no progress reported, still held');
  await assert.rejects(slot.release(), refusedUnsent('pool#1', /no progress/));
  await assert.rejects(b.claimSlot('pool', 1), (e) => e instanceof LeaseHeld
    && ['urn:fence:lease-held', 'urn:fence:lock-delay'].includes(e.type));
  assert.equal(await finishesAnswered(s.serverUrl), 0);
  // A completion after a loss is still sent: nobody can claim a completed job. (The lease is
  // still this owner's at the server, so it takes it.) A release after it is not sent.
  lease = await stalls.claim('completed-after-loss');
  await abortedWithin(lease.signal, 10_000, 'no progress reported, still held');
  assert.equal((await lease.complete()).state, 'completed');
  assert.equal(await finishesAnswered(s.serverUrl), 1);
  await assert.rejects(lease.release(), refusedUnsent('completed-after-loss', /no progress/));
  assert.equal(await finishesAnswered(s.serverUrl), 1);
});

/**
 * Records the releases and completions sent from now on (until the test ends): [action, job
 * path] of each request that went out to the lease server.
 */
function recordFinishes(t) {
  const sent = [];
  const real = Transport.prototype.call;
  Transport.prototype.call = function recording(method, path, ...rest) {
    const m = /^\/v1\/leases\/([^/]+)\/(release|complete)$/.exec(path);
    if (m) sent.push([m[2], decodeURIComponent(m[1])]);
    return real.call(this, method, path, ...rest);
  };
  t.after(() => { Transport.prototype.call = real; });
  return sent;
}

/**
 * Blocks the event loop past `lease`'s local deadline: the keeper's timers cannot fire, so the
 * deadline has passed and nothing has declared the lease lost yet.
 */
function blockPastDeadline(lease) {
  const ms = Math.max(Math.ceil(lease.deadline - now()) + 20, 0);
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms); // a blocked loop, not a busy one
  assert.ok(now() > lease.deadline);
  assert.equal(lease.lossReason, null, 'the keeper did not run');
}

test('a slot completion by hand after a local loss sends nothing', async (t) => {
  // The server takes a slot's completion as a release (the slot is freed at once): sent after a
  // loss here, it let the next claimer in beside a write cut by the loss, skipping the
  // lock-delay, as a release by hand did.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const stalls = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000, progressWithinMs: 300 });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000 });
  const b = new Client({ server: s.serverUrl, owner: 'b', ttlMs: 10_000 });
  t.after(() => { stalls.close(); a.close(); b.close(); });
  const sent = recordFinishes(t);
  const refusedUnsent = (job, why) => (e) => {
    assert.ok(e instanceof LeaseLost && !(e instanceof LeaseRefused), String(e)); // not the server's
    assert.equal(e.job, job);
    assert.match(e.reason, why);
    assert.match(e.reason, /nothing was sent/);
    return true;
  };
  const slotLeftToExpire = async (resource) => {
    await assert.rejects(b.claimSlot(resource, 1), (e) => {
      assert.ok(e instanceof LeaseHeld, String(e));
      assert.ok(['urn:fence:lease-held', 'urn:fence:lock-delay'].includes(e.type), e.type);
      assert.equal(e.problem.owner, 'a');
      return true;
    });
    assert.equal(await finishesAnswered(s.serverUrl), 0, resource);
  };
  let slot = await stalls.claimSlot('stalled', 1);
  await abortedWithin(slot.signal, 10_000, 'no progress reported, still held');
  await assert.rejects(slot.complete(), refusedUnsent('stalled#1', /no progress/));
  await assert.rejects(slot.complete(), refusedUnsent('stalled#1', /no progress/)); // again: nothing sent
  await slotLeftToExpire('stalled');
  // The local deadline passed, the keeper has not said it yet: refused all the same.
  slot = await a.claimSlot('masked', 1);
  blockPastDeadline(slot);
  await assert.rejects(slot.complete(), refusedUnsent('masked#1', /local deadline passed/));
  await slotLeftToExpire('masked');
  slot = await a.claimSlot('abandoned', 1);
  slot.abandon();
  await assert.rejects(slot.complete(), refusedUnsent('abandoned#1', /abandoned/));
  await slotLeftToExpire('abandoned');
  assert.deepEqual(sent, []);
});

test('a failed completion past the deadline lets no release out', async (t) => {
  // complete() called once the local deadline had passed, before the keeper noticed, marked the
  // lease finished, hiding the loss; when the completion then failed unapplied (a server blip),
  // a `finally { await lease.release(); }` was sent, and a server that took it let the next
  // holder in at once, skipping the lock-delay.
  const s = await stack(t, { proxy: false, serverArgs: ['--lock-delay', '30s'] });
  const a = new Client({ server: s.serverUrl, owner: 'a', ttlMs: 1000 });
  t.after(() => a.close());
  const sent = recordFinishes(t);
  const lease = await a.claim('masked');
  s.server.signal('SIGKILL'); // the completion fails, not applied (killed while the loop is blocked)
  blockPastDeadline(lease);
  await assert.rejects(lease.complete(), ServerUnreachable); // a plain job's: still sent after a loss
  assert.ok(sent.length > 0 && sent.every(([action]) => action === 'complete'), JSON.stringify(sent));
  assert.match(lease.lossReason, /local deadline passed/); // not "finished"
  const completions = sent.length;
  await assert.rejects(lease.release(), (e) => {
    assert.ok(e instanceof LeaseLost && !(e instanceof ServerUnreachable), String(e));
    assert.match(e.reason, /local deadline passed/);
    assert.match(e.reason, /nothing was sent/);
    return true;
  });
  assert.equal(sent.length, completions, JSON.stringify(sent));
});

test('a worker that stops reporting progress loses its lease', async (t) => {
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'bound', ttlMs: 900, progressWithinMs: 600 });
  t.after(() => client.close());
  const lease = await client.claim('bound-job');
  for (let i = 0; i < 10; i++) { // 2 s of steady progress: renewed every 300 ms
    await sleep(200);
    lease.progress();
  }
  assert.ok(!lease.isLost(), String(lease.lossReason));
  await sleep(1500);
  assert.ok(lease.isLost() && /no progress/.test(lease.lossReason), String(lease.lossReason));
  assert.throws(() => new Client({ server: s.serverUrl, progressWithinMs: 0 }), RangeError);
  lease.abandon();
});

test('a checkpoint goes to the next holder', async (t) => {
  const s = await stack(t, { proxy: false });
  const first = new Client({ server: s.serverUrl, owner: 'first', ttlMs: 1000 });
  const second = new Client({ server: s.serverUrl, owner: 'second' });
  t.after(() => { first.close(); second.close(); });
  const a = await first.claim('resumable');
  assert.equal(a.checkpoint, null);
  const record = await a.saveCheckpoint('rows 0-999 done');
  assert.equal(record.generation, 1n);
  await assert.rejects(a.saveCheckpoint('x'.repeat(8193)), (e) => e instanceof ProblemError && e.status === 413);
  a.abandon();
  await sleep(1200);
  const b = await second.claim('resumable');
  assert.deepEqual(b.checkpoint, { generation: 1n, data: 'rows 0-999 done' });
  await assert.rejects(a.saveCheckpoint('stale'), LeaseLost);
  await b.saveCheckpoint('rows 0-2999 done');
  await b.release();
});

test('renewals follow a shorter grant', async (t) => {
  const s = await stack(t, { proxy: false, serverArgs: ['--max-ttl', '600ms'] });
  const client = new Client({ server: s.serverUrl, ttlMs: 30_000 });
  t.after(() => client.close());
  const lease = await client.claim('capped');
  assert.equal(lease.ttlMs, 600);
  assert.ok(lease.deadline - performance.now() < 600);
  await sleep(1000); // renewed every 200 ms, not every 10 s
  assert.equal(lease.isLost(), false);
  await lease.release();
});

test('a fixed margin that takes most of a capped grant still renews in time', async (t) => {
  // 30 s asked, 2 s granted, 1.5 s margin: the deadline is 0.5 s after each send, before a
  // third of the grant; renewals come halfway to it.
  const s = await stack(t, { proxy: false, serverArgs: ['--max-ttl', '2s'] });
  const client = new Client({ server: s.serverUrl, ttlMs: 30_000, marginMs: 1_500 });
  t.after(() => client.close());
  const lease = await client.claim('capped-margin');
  await sleep(2000);
  assert.equal(lease.isLost(), false, String(lease.lossReason));
  await lease.release();
});

test('idempotency key matches the binary', () => {
  const out = execFileSync(fenceBin(), ['idempotency-key', '--job', 'invoice-42', '--step', 'charge']).toString().trim();
  assert.equal(idempotencyKey('invoice-42', 'charge'), out);
});

test('timing options are checked', () => {
  assert.throws(() => new Client({ server: 'http://127.0.0.1:9', ttlMs: 50 }), RangeError);
  assert.throws(() => new Client({ server: 'http://127.0.0.1:9', ttlMs: 1000, marginMs: 1000 }), RangeError);
  assert.throws(() => new Client({ server: 'ftp://127.0.0.1:7700' }), TypeError);
});

test('a server URL with a user or password is refused without quoting them', () => {
  // The server takes bearer secrets only, and the server URL is quoted in error messages.
  for (const server of ['http://alice:hunter2-pw@127.0.0.1:7700', 'https://alice@fence.example/',
    'http://alice:pa/hunter2-pw@127.0.0.1:7700', 'http://alice:hunter2-pw@[::1']) {
    assert.throws(() => new Client({ server }), (e) => {
      assert.ok(e instanceof TypeError, String(e));
      assert.match(e.message, /user or password.*authToken/);
      assert.ok(!/hunter2|alice/.test(`${e.message} ${JSON.stringify(e)}`), e.message);
      return true;
    });
  }
  // A URL refused for its scheme is quoted without what it carries before an '@'.
  for (const server of ['ftp://alice:hunter2-pw@127.0.0.1:7700', 'alice:hunter2-pw@127.0.0.1:7700',
    'ftp://alice:pa/hunter2-pw@127.0.0.1:7700/x']) {
    assert.throws(() => new Client({ server }), (e) => {
      assert.ok(e instanceof TypeError, String(e));
      assert.match(e.message, /must start with http:\/\/ or https:\/\/, not .*127\.0\.0\.1:7700/);
      assert.ok(!/hunter2|alice/.test(`${e.message} ${JSON.stringify(e)}`), e.message);
      return true;
    });
  }
});

// A loopback URL nothing listens on: a connection to it is refused.
async function closedPortUrl() {
  const { createServer } = await import('node:net');
  const server = createServer();
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  const { port } = server.address();
  await new Promise((r) => server.close(r));
  return `http://127.0.0.1:${port}`;
}

test('a list of servers moves on only from one it could not connect to', async (t) => {
  // FENCE_SERVER may name several servers that share one database (`fence run --server
  // http://a:7700,http://b:7700` passes it on as is); before, the list was refused as a URL.
  const s = await stack(t, { proxy: false });
  const down = await closedPortUrl();
  const saved = process.env.FENCE_SERVER;
  t.after(() => { if (saved === undefined) delete process.env.FENCE_SERVER; else process.env.FENCE_SERVER = saved; });
  process.env.FENCE_SERVER = `${down}, ${s.serverUrl}/`;
  const client = new Client({ owner: 'listed', ttlMs: 1000 });
  t.after(() => client.close());
  await client.run('listed', async (lease) => {
    await sleep(1200); // renewed through the server that answered
    assert.ok(!lease.isLost(), lease.lossReason);
  });
  assert.equal(client.server, `${down},${s.serverUrl}`);
  const observer = new Client({ server: s.serverUrl });
  t.after(() => observer.close());
  assert.equal((await observer.status('listed')).state, 'completed');
  // A server that took the request and did not answer may have decided it: the next one is
  // never asked.
  const { createServer } = await import('node:net');
  let requests = 0;
  const hangup = createServer((socket) => socket.once('data', () => { requests++; socket.destroy(); }));
  await new Promise((r) => hangup.listen(0, '127.0.0.1', r));
  t.after(() => hangup.close());
  const hangupUrl = `http://127.0.0.1:${hangup.address().port}`;
  const unanswered = new Client({ server: `${hangupUrl},${s.serverUrl}`, owner: 'listed' });
  t.after(() => unanswered.close());
  await assert.rejects(unanswered.claim('unanswered'), (e) => e instanceof ServerUnreachable && e.message.includes(hangupUrl));
  assert.equal(requests, 1);
  await assert.rejects(observer.status('unanswered'), (e) => e instanceof ProblemError && e.status === 404);
  // None answering: the last one's failure, named.
  const none = new Client({ server: `${await closedPortUrl()},${down}` });
  await assert.rejects(none.status('x'), (e) => e instanceof ServerUnreachable && e.message.includes(down));
  assert.throws(() => new Client({ server: `${s.serverUrl},127.0.0.1:7700` }), /must start with http:\/\/ or https:\/\//);
});

test('a claim TTL no longer than the margin is refused before sending', async (t) => {
  // Before, such a claim was sent with a negative time budget (clamped to 1 ms): the caller
  // saw ServerUnreachable while the server granted the job to this owner, held unused.
  const s = await stack(t, { proxy: false });
  const client = new Client({ server: s.serverUrl, owner: 'short', ttlMs: 10_000, marginMs: 2000 });
  t.after(() => client.close());
  for (const ttlMs of [1000, 2000]) {
    await assert.rejects(client.claim('short', { ttlMs }), (e) => e instanceof RangeError && /margin/.test(e.message));
    await assert.rejects(client.claimSlot('shorts', 2, { ttlMs }), (e) => e instanceof RangeError && /margin/.test(e.message));
  }
  for (const job of ['short', 'shorts#1']) {
    await assert.rejects(client.status(job), (e) => e instanceof ProblemError && e.status === 404);
  }
  const lease = await client.claim('short', { ttlMs: 2100 }); // longer than the margin: claimed
  await lease.release();
});
