// What a lease server (or a proxy in front of it) answers cannot crash the worker's process
// or fill its memory: every call settles with an error of this client's, whatever the body.

import assert from 'node:assert/strict';
import http from 'node:http';
import { test } from 'node:test';

import { ProblemError, ProtocolError } from '../src/index.js';
import { problemError } from '../src/errors.js';
import { stringifyJson } from '../src/json.js';
import { MAX_ANSWER, Transport, grantOf } from '../src/wire.js';

/** A server on 127.0.0.1 answering every request with `answer(res)`; its URL. */
async function serving(t, answer) {
  const server = http.createServer((req, res) => {
    req.resume();
    answer(res);
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  t.after(() => {
    server.closeAllConnections();
    server.close();
  });
  return `http://127.0.0.1:${server.address().port}`;
}

test('problems whose type names an inherited member, or whose members are not text', async (t) => {
  for (const type of ['toString', '__proto__', 'constructor', 'hasOwnProperty']) {
    const e = problemError(409, 'application/problem+json', JSON.stringify({ type, detail: { toString: 0 } }));
    assert.ok(e instanceof ProblemError, `${type}: ${e}`);
    assert.equal(e.type, type);
    assert.equal(e.detail, '');
  }
  const odd = problemError(503, 'application/problem+json', '{"type":"urn:x","status":{"toString":0},"title":[1]}');
  assert.equal(odd.status, 503);
  assert.equal(odd.title, '');
  // Through a real call: the promise settles with the problem, and the process lives on.
  const url = await serving(t, (res) => {
    res.writeHead(500, { 'content-type': 'application/problem+json' });
    res.end('{"type":"toString","detail":{"toString":0},"status":"x"}');
  });
  const transport = new Transport({ server: url, timeoutMs: 5000 });
  t.after(() => transport.close());
  await assert.rejects(transport.call('GET', '/v1/leases/j'), (e) => e instanceof ProblemError && e.status === 500);
});

test('an answer larger than the client reads is refused, not buffered', async (t) => {
  const url = await serving(t, (res) => {
    res.writeHead(200, { 'content-type': 'application/json' });
    const chunk = Buffer.alloc(64 << 10, 0x20);
    let sent = 0;
    const more = () => {
      while (sent < 64 << 20) {
        sent += chunk.length;
        if (!res.write(chunk)) return res.once('drain', more);
      }
      res.end();
    };
    res.on('error', () => {});
    more();
  });
  const transport = new Transport({ server: url, timeoutMs: 20_000 });
  t.after(() => transport.close());
  await assert.rejects(transport.call('GET', '/v1/leases/j'),
    (e) => e instanceof ProtocolError && e.message.includes(`larger than ${MAX_ANSWER} bytes`));
});

test('a lease answer without its numbers is a protocol error, not a TypeError', () => {
  assert.throws(() => grantOf('j', 3n, { generation: 3n }),
    (e) => e instanceof ProtocolError && e.message.includes('"generation":3'));
});

test('a checkpoint of NUL and digits stays text', () => {
  assert.equal(stringifyJson({ generation: 7n, checkpoint: '\u0000123' }),
    '{"generation":7,"checkpoint":"\\u0000123"}');
});
