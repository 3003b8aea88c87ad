// A scripted lease server for answers the real one never gives (a renewal held open forever,
// a gateway's 408, a crowded server's 429, a TTL above what was asked, an echo of the request).

import http from 'node:http';

/** A 200 granting generation 1 for the TTL asked (or `ttlMs`). */
export function grant(body, ttlMs) {
  const ttl = ttlMs ?? body.ttl_ms ?? 1000;
  return [200, { 'content-type': 'application/json' },
    JSON.stringify({ job: 'j', owner: body.owner, generation: 1, state: 'held', ttl_ms: ttl, expires_at_ms: Date.now() + ttl })];
}

/** A problem+json answer of type urn:fence:<kind>. */
export function problem(status, kind, headers = {}) {
  return [status, { 'content-type': 'application/problem+json', ...headers },
    JSON.stringify({ type: `urn:fence:${kind}`, title: kind, status, detail: kind })];
}

/**
 * Answers each request with `script(action, body, n)`: action the path's last part (claim,
 * renew, release...), n how many requests of that action came before; null holds it open
 * until the server is closed. Closed when the test ends.
 */
export async function fakeServer(t, script) {
  const seen = [];
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      const body = chunks.length ? JSON.parse(Buffer.concat(chunks).toString()) : {};
      const action = req.url.split('?')[0].split('/').pop();
      const n = seen.filter((s) => s.action === action).length;
      seen.push({ action, body, path: req.url });
      const reply = script(action, body, n);
      if (reply === null) return; // taken, never answered
      const [status, headers, payload] = reply;
      res.writeHead(status, { ...headers, 'content-length': Buffer.byteLength(payload) });
      res.end(payload);
    });
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  t.after(() => { server.closeAllConnections(); server.close(); });
  return {
    seen,
    url: `http://127.0.0.1:${server.address().port}`,
    count: (action) => seen.filter((s) => s.action === action).length,
  };
}
