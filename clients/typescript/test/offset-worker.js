// A worker run by faults.test.js under libfaketime, its wall clock an hour off: it claims,
// writes through the proxy, keeps its lease past one TTL by renewing, then stops renewing and
// reports when its signal aborts. One JSON line per event on stdout.

import { Client, LeaseLost } from '../src/index.js';

const [server, ledger, job] = process.argv.slice(2);
const say = (event, more = {}) => process.stdout.write(`${JSON.stringify({ event, ...more })}\n`);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const client = new Client({ server, owner: `offset-${job}`, ttlMs: 2000 });
const lease = await client.claim(job);
say('claimed', { wall: Date.now(), generation: String(lease.generation) });
say('write', { status: (await lease.fetch(ledger, { method: 'POST', body: 'write 1' })).status });
await sleep(2500); // past the TTL: only renewals keep the lease
say('held', { held: !lease.isLost() });
say('write', { status: (await lease.fetch(ledger, { method: 'POST', body: 'write 2' })).status });
lease._sendRenew = () => new Promise(() => {}); // no renewal reaches the server from now on
const fired = await Promise.race([
  new Promise((r) => lease.signal.addEventListener('abort', () => r(true), { once: true })),
  sleep(5000).then(() => false),
]);
say(fired ? 'lost' : 'not-lost', { expires_at_ms: lease.expiresAtMs, reason: lease.lossReason });
try {
  await lease.fetch(ledger, { method: 'POST', body: 'write 3' });
  say('sent-after-loss');
} catch (e) {
  if (!(e instanceof LeaseLost)) throw e;
  say('refused');
}
client.close();
