// Faults: a worker whose wall clock is an hour off (libfaketime), and a lease server that
// stops answering (SIGSTOP). In both the signal must abort before the server's expiry.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { test } from 'node:test';

import { Client, LeaseLost } from '../src/index.js';
import { CLIENT_DIR, abortedWithin, sleep, stack } from './helpers.js';

const LIBFAKETIME = ['/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1', '/usr/lib/faketime/libfaketime.so.1'];

function runOffsetWorker(lib, offset, args) {
  const child = spawn(process.execPath, [join(CLIENT_DIR, 'test', 'offset-worker.js'), ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    // The wall clock is off, the monotonic clock is not (as on a machine whose clock was
    // set wrong).
    env: { ...process.env, LD_PRELOAD: lib, FAKETIME: offset, FAKETIME_DONT_FAKE_MONOTONIC: '1' },
  });
  const events = [];
  let stderr = '';
  child.stderr.on('data', (d) => { stderr += d; });
  createInterface({ input: child.stdout }).on('line', (line) => events.push([Date.now(), JSON.parse(line)]));
  // A worker that does not notice its loss would otherwise run on for an hour.
  const timer = setTimeout(() => child.kill('SIGKILL'), 20_000);
  return new Promise((resolve) => child.on('close', (code, signal) => {
    clearTimeout(timer);
    resolve({ code: code ?? signal, events, stderr });
  }));
}

test('a worker whose wall clock is an hour off', { timeout: 60_000 }, async (t) => {
  const lib = LIBFAKETIME.find((p) => existsSync(p));
  assert.ok(lib, 'libfaketime is missing: apt-get install faketime');
  const s = await stack(t);
  const offsets = ['+1h', '-1h'];
  const runs = await Promise.all(offsets.map((o) => runOffsetWorker(lib, o, [s.serverUrl, `${s.proxyUrl}/ledger`, `offset${o}`])));
  for (const [i, offset] of offsets.entries()) {
    const { code, events, stderr } = runs[i];
    const said = JSON.stringify(events.map(([, e]) => e));
    assert.equal(code, 0, `${offset}: ${said} ${stderr}`);
    const by = Object.fromEntries(events.map(([at, e]) => [e.event, [at, e]]));
    const [at, claimed] = by.claimed;
    const skew = (claimed.wall - at) / 1000;
    assert.ok(Math.abs(skew - (offset === '+1h' ? 3600 : -3600)) < 60, `${offset}: faketime did not take: skew ${skew} s`);
    assert.deepEqual(events.filter(([, e]) => e.event === 'write').map(([, e]) => e.status), [200, 200], said);
    assert.equal(by.held?.[1].held, true, said);
    assert.ok(by.lost, `${offset}: the signal did not abort: ${said}`);
    assert.ok(by.lost[0] < by.lost[1].expires_at_ms, `${offset}: lost after the server's expiry: ${said}`);
    assert.ok(by.refused, said);
    const client = new Client({ server: s.serverUrl });
    assert.equal((await client.status(`offset${offset}`)).generation, 1n);
    client.close();
  }
  assert.deepEqual(s.upstream.seen.map((w) => w.body).sort(), ['write 1', 'write 1', 'write 2', 'write 2']);
});

test('a server that stops answering', { timeout: 60_000 }, async (t) => {
  const s = await stack(t);
  const client = new Client({ server: s.serverUrl, owner: 'stopped', ttlMs: 2000 });
  t.after(() => client.close());
  const leases = [await client.claim('stopped-1'), await client.claim('stopped-2')];
  await sleep(2200); // past the TTL: renewals keep both
  for (const lease of leases) assert.equal(lease.isLost(), false);
  s.server.signal('SIGSTOP');
  const stoppedAt = Date.now();
  try {
    const lostAt = await Promise.all(leases.map((l) => abortedWithin(l.signal, 4000, `${l.job}: the signal aborts`)));
    for (const [i, lease] of leases.entries()) {
      assert.ok(stoppedAt < lostAt[i] && lostAt[i] < lease.expiresAtMs, `${lease.job}: ${stoppedAt} < ${lostAt[i]} < ${lease.expiresAtMs}`);
      assert.match(lease.lossReason, /deadline/);
      await assert.rejects(lease.fetch(`${s.proxyUrl}/ledger`, { method: 'POST', body: 'late' }), LeaseLost);
    }
  } finally {
    s.server.signal('SIGCONT');
  }
  assert.deepEqual(s.upstream.seen, []);
});
