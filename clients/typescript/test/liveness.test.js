// Answers the real server never gives, from a scripted one: each must leave the lease (or the
// claim) as the contract says.

import assert from 'node:assert/strict';
import { test } from 'node:test';

import { Client } from '../src/index.js';
import { fakeServer, grant } from './fake-server.js';
import { sleep } from './helpers.js';

test('a renewal that never answers is abandoned and asked again', async (t) => {
  const server = await fakeServer(t, (action, body, n) => (action === 'renew' && n === 0 ? null : grant(body)));
  const client = new Client({ server: server.url, owner: 'o', ttlMs: 1000 });
  t.after(() => client.close());
  const lease = await client.claim('j');
  await sleep(1500); // past the claim's deadline: only a later renewal keeps the lease
  assert.equal(lease.isLost(), false, lease.lossReason);
  assert.ok(server.count('renew') >= 2);
  lease.abandon();
});
