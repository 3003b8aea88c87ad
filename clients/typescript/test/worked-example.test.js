// The seed's worked example with the real server and proxy: A claims generation 7, is paused
// past its lease, B claims generation 8 and writes, A's late write is refused 409 at the
// proxy, A's completion is refused.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { Client, LeaseLost, LeaseRefused, StaleToken, fencedFetch, raiseForProblem } from '../src/index.js';
import { abortedWithin, raw, stack, waitFor } from './helpers.js';

const JOB = 'invoice-42';

/** A whole-keeper pause (GC, SIGSTOP): from now on no renewal reaches the server. */
function pauseRenewals(lease) {
  let resume;
  const paused = new Promise((r) => { resume = r; });
  lease._sendRenew = () => paused.then(() => { throw new Error('the worker was paused'); });
  return resume;
}

async function sixEarlierRuns(serverUrl) {
  const earlier = new Client({ server: serverUrl, owner: 'earlier-runs', ttlMs: 1000 });
  for (let n = 1n; n <= 5n; n++) {
    await earlier.run(JOB, async (lease) => assert.equal(lease.generation, n), { onSuccess: 'release' });
  }
  // Completes when the callback resolves, releases when it throws.
  await assert.rejects(earlier.run(JOB, async (lease) => {
    assert.equal(lease.generation, 6n);
    throw new Error('the job failed');
  }), /the job failed/);
  const record = await earlier.status(JOB);
  assert.deepEqual([record.state, record.generation], ['free', 6n]);
  earlier.close();
}

for (const signing of [true, false]) {
  test(`worked example (${signing ? 'signed' : 'plain'} tokens)`, { timeout: 60_000 }, async (t) => {
    const s = await stack(t, { signing });
    const ledger = `${s.proxyUrl}/ledger`;
    await sixEarlierRuns(s.serverUrl);

    const a = new Client({ server: s.serverUrl, owner: 'worker-a', ttlMs: 2000 });
    const leaseA = await a.claim(JOB);
    assert.equal(leaseA.generation, 7n);
    const first = leaseA.token;
    if (signing) {
      assert.match(first, /^7\.\d+\.[A-Za-z0-9_-]{86}$/);
    } else {
      assert.equal(first, '7');
    }
    let r = await leaseA.fetch(ledger, { method: 'POST', body: 'A: charge 10 EUR' });
    assert.equal(r.status, 200);
    if (signing) {
      // Each renewal is signed anew, and the newest token is the one sent.
      await waitFor('a renewal brings a new signed token', 2000, () => leaseA.token !== first);
    } else {
      await new Promise((res) => setTimeout(res, 2200)); // past the TTL: renewals keep it
    }
    r = await fencedFetch(leaseA)(ledger, { method: 'POST', body: 'A: note' });
    assert.equal(r.status, 200);
    assert.equal(s.upstream.seen.at(-1).token, leaseA.token);
    assert.equal(s.upstream.seen.at(-1).job, JOB);

    const lateToken = leaseA.token; // A decides to write once more with the token it holds...
    const resume = pauseRenewals(leaseA); // ...and stalls before the write goes out
    try {
      const lostAt = await abortedWithin(leaseA.signal, 3000, "A's lost signal");
      assert.ok(lostAt < leaseA.expiresAtMs, `before the server's expiry: ${lostAt} < ${leaseA.expiresAtMs}`);
      assert.ok(leaseA.signal.reason instanceof LeaseLost);
      assert.match(leaseA.lossReason, /deadline/);
      const sent = s.upstream.seen.length;
      await assert.rejects(leaseA.fetch(ledger, { method: 'POST', body: 'A: refund' }), LeaseLost);
      assert.equal(s.upstream.seen.length, sent, 'the wrapper sent nothing after the loss');

      const b = new Client({ server: s.serverUrl, owner: 'worker-b', ttlMs: 5000 });
      await b.run(JOB, async (leaseB) => { // granted at the server-side expiry
        assert.equal(leaseB.generation, 8n);
        const w = await leaseB.fetch(ledger, { method: 'POST', body: 'B: charge 10 EUR' });
        assert.equal(w.status, 200);
        // A's held-up write arrives, sent raw (no client check): the proxy refuses it.
        const late = await raw('POST', ledger, { 'X-Fencing-Job': JOB, 'X-Fencing-Token': lateToken }, 'A: refund');
        assert.equal(late.status, 409);
        assert.equal(late.body.type, 'urn:fence:stale-token');
        assert.equal(String(late.body.highest).split('.')[0], '8');
        const viaFetch = await fetch(ledger, { method: 'POST', body: 'A: refund', headers: { 'X-Fencing-Job': JOB, 'X-Fencing-Token': lateToken } });
        await assert.rejects(raiseForProblem(viaFetch), (e) => e instanceof StaleToken && e.status === 409);
        await assert.rejects(leaseA.complete(), (e) => {
          assert.ok(e instanceof LeaseRefused && e instanceof LeaseLost);
          assert.deepEqual([e.status, e.type, e.problem.owner, e.generation], [409, 'urn:fence:lease-lost', 'worker-b', 8n]);
          return true;
        });
      }, { waitMs: 5000 });
      assert.equal((await b.status(JOB)).state, 'completed');
      b.close();
    } finally {
      resume();
      a.close();
    }
    assert.deepEqual(s.upstream.seen.map((w) => [w.token.split('.')[0], w.body]),
      [['7', 'A: charge 10 EUR'], ['7', 'A: note'], ['8', 'B: charge 10 EUR']]);
  });
}
