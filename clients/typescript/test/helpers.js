// Test helpers: the real `fence server` and `fence proxy` as child processes on ephemeral
// loopback ports, an upstream that records what reached it, raw HTTP that bypasses the client.

import { spawn, execFileSync } from 'node:child_process';
import { accessSync, constants, mkdtempSync, rmSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';

export const CLIENT_DIR = resolve(dirname(fileURLToPath(import.meta.url)), '..');

/** FENCE_BIN, else ../../target/debug/fence from the client directory; missing fails the test. */
export function fenceBin() {
  const path = resolve(process.env.FENCE_BIN || join(CLIENT_DIR, '..', '..', 'target', 'debug', 'fence'));
  try {
    accessSync(path, constants.X_OK);
  } catch {
    throw new Error(`the fence binary is missing at ${path}: build it (cargo build) or set FENCE_BIN`);
  }
  return path;
}

/** `fence ARGS...` once it logged its ready line; `addr` (and `admin`) parsed from it. */
export function startFence(args) {
  return new Promise((resolvePromise, reject) => {
    const child = spawn(fenceBin(), args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, RUST_LOG: 'info' } });
    const log = [];
    const proc = {
      child,
      log,
      signal(sig) { process.kill(child.pid, sig); },
      async kill() {
        if (child.exitCode !== null || child.signalCode !== null) return;
        const exited = new Promise((r) => child.once('exit', r));
        try { process.kill(child.pid, 'SIGCONT'); } catch {}
        child.kill('SIGKILL');
        await exited;
      },
    };
    const timer = setTimeout(() => {
      child.kill('SIGKILL');
      reject(new Error(`fence ${args.join(' ')} did not get ready:\n${log.join('\n')}`));
    }, 15_000);
    child.on('error', (e) => { clearTimeout(timer); reject(e); });
    createInterface({ input: child.stderr }).on('line', (line) => {
      log.push(line);
      if (line.includes(' ready ') && !proc.addr) {
        clearTimeout(timer);
        proc.addr = /listen=(\S+)/.exec(line)[1];
        proc.admin = /admin=(\S+)/.exec(line)?.[1];
        resolvePromise(proc);
      }
    });
  });
}

/** The service behind the proxy: answers 200 and records every request that reached it. */
export function startUpstream() {
  const seen = [];
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      seen.push({ method: req.method, path: req.url, job: req.headers['x-fencing-job'],
        token: req.headers['x-fencing-token'], body: Buffer.concat(chunks).toString() });
      res.writeHead(200, { 'content-length': '3' });
      res.end('ok\n');
    });
  });
  return new Promise((r) => server.listen(0, '127.0.0.1', () => {
    r({ seen, url: `http://127.0.0.1:${server.address().port}`, close: () => { server.closeAllConnections(); server.close(); } });
  }));
}

/**
 * A lease server (and a proxy in front of a recording upstream), each with its own data
 * directory; everything is killed when the test ends (`t.after`).
 */
export async function stack(t, { signing = false, proxy = true, serverArgs = [], scheme = 'http' } = {}) {
  const dir = mkdtempSync(join(tmpdir(), 'fence-ts-'));
  const cleanups = [];
  t.after(async () => {
    for (const c of cleanups.reverse()) await c();
    rmSync(dir, { recursive: true, force: true });
  });
  const args = ['server', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'leases')];
  const keys = join(dir, 'keys');
  if (signing) {
    execFileSync(fenceBin(), ['keygen', '--out', keys], { stdio: 'ignore' });
    args.push('--signing-key', join(keys, 'fence-signing.pem'));
  }
  const server = await startFence([...args, ...serverArgs]);
  cleanups.push(() => server.kill());
  const s = { dir, server, serverUrl: `${scheme}://${server.addr}` };
  if (proxy) {
    s.upstream = await startUpstream();
    cleanups.push(() => s.upstream.close());
    const pargs = ['proxy', '--listen', '127.0.0.1:0', '--admin-listen', '127.0.0.1:0',
      '--upstream', s.upstream.url, '--data-dir', join(dir, 'sink')];
    if (signing) pargs.push('--verify-key', join(keys, 'fence-verify.pem'));
    s.proxy = await startFence(pargs);
    cleanups.push(() => s.proxy.kill());
    s.proxyUrl = `http://${s.proxy.addr}`;
  }
  return s;
}

/** One request with node:http, bypassing the client: { status, body (JSON or text) }. */
export function raw(method, url, headers = {}, body) {
  return new Promise((resolvePromise, reject) => {
    // The path goes out as written: http.request(url) would resolve `.` and `..` segments.
    const [, host, port, path] = /^http:\/\/([^:/]+):(\d+)(\/.*)$/.exec(url);
    const req = http.request({ host, port, path, method, headers, agent: false }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString();
        let parsed = text;
        try { parsed = JSON.parse(text); } catch {}
        resolvePromise({ status: res.statusCode, body: parsed });
      });
    });
    req.on('error', reject);
    req.end(body);
  });
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Resolves with the wall time (ms) when `signal` aborts, or rejects after `withinMs`. */
export function abortedWithin(signal, withinMs, what) {
  if (signal.aborted) return Promise.resolve(Date.now());
  return new Promise((resolvePromise, reject) => {
    const timer = setTimeout(() => reject(new Error(`not within ${withinMs} ms: ${what}`)), withinMs);
    signal.addEventListener('abort', () => { clearTimeout(timer); resolvePromise(Date.now()); }, { once: true });
  });
}

export async function waitFor(what, withinMs, done) {
  const until = performance.now() + withinMs;
  while (!done()) {
    if (performance.now() > until) throw new Error(`not within ${withinMs} ms: ${what}`);
    await sleep(10);
  }
}
