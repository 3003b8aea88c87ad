// The wire half of the client: job ids in paths, HTTP calls to the lease server, timing.
//
// Lease calls use node:http and node:https rather than fetch: a CA file must replace the
// system roots (https' `ca` option), and a path must go out exactly as encoded (the WHATWG URL
// parser behind fetch would resolve a job id `.` or `..` away as a dot segment).

import { createHash, randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import { hostname } from 'node:os';

import { InvalidJobId, ProtocolError, ServerUnreachable, problemError } from './errors.js';
import { parseJson, redact, stringifyJson } from './json.js';

const UNRESERVED = /[A-Za-z0-9\-._~]/;

/**
 * Returns `job` if it is a valid job id (1 to 256 bytes, each visible ASCII 0x21 to 0x7E),
 * else throws InvalidJobId: a space or anything outside visible ASCII never leaves the client.
 * @param {string} job
 */
export function checkJob(job) {
  if (typeof job !== 'string') throw new InvalidJobId(`a job id is a string, not ${typeof job}`);
  if (job.length < 1 || job.length > 256) {
    throw new InvalidJobId(`a job id has 1 to 256 characters, not ${job.length}`);
  }
  for (let i = 0; i < job.length; i++) {
    const c = job.charCodeAt(i);
    if (c < 0x21 || c > 0x7e) {
      throw new InvalidJobId(
        `job id ${JSON.stringify(job)} has ${JSON.stringify(job[i])} at offset ${i}: only visible ASCII (0x21 to 0x7E) is allowed`,
      );
    }
  }
  return job;
}

/** The most slots a semaphore has. */
export const MAX_SLOTS = 1000;

/**
 * Returns `resource` if it can name a semaphore: a job id of at most 251 characters (its slots'
 * job ids `<resource>#<slot>` add '#' and up to 4 digits) without '#', which separates a
 * resource from its slot number; else throws InvalidJobId, before anything is sent.
 * @param {string} resource
 */
export function checkResource(resource) {
  if (typeof resource !== 'string') throw new InvalidJobId(`a resource name is a string, not ${typeof resource}`);
  if (resource.length > 251) {
    throw new InvalidJobId(`a resource name has 1 to 251 characters, not ${resource.length} (its slots' job ids add '#' and up to 4 digits)`);
  }
  checkJob(resource);
  if (resource.includes('#')) {
    throw new InvalidJobId(`resource name ${JSON.stringify(resource)} holds '#', which separates a resource from its slot number in a slot's job id`);
  }
  return resource;
}

/**
 * Returns `slots` if it is a semaphore's number of slots, an integer from 1 to 1000; else
 * throws RangeError, before anything is sent.
 * @param {number} slots
 */
export function checkSlots(slots) {
  if (!Number.isInteger(slots) || slots < 1 || slots > MAX_SLOTS) {
    throw new RangeError(`a semaphore has 1 to ${MAX_SLOTS} slots, not ${slots}`);
  }
  return slots;
}

/**
 * The job id percent-encoded for a URL path: every byte but A-Z a-z 0-9 - . _ ~.
 * @param {string} job
 */
export function encodeJob(job) {
  let out = '';
  for (const ch of checkJob(job)) {
    out += UNRESERVED.test(ch) ? ch : `%${ch.charCodeAt(0).toString(16).toUpperCase().padStart(2, '0')}`;
  }
  return out;
}

/**
 * The derived Idempotency-Key of one step of a job (contract section 11): the same for every
 * holder of every generation, for third-party APIs that deduplicate by key.
 * @param {string} job
 * @param {string} step
 */
export function idempotencyKey(job, step) {
  const digest = createHash('sha256')
    .update(Buffer.concat([Buffer.from('fence-step-v1\0'), Buffer.from(checkJob(job), 'ascii'),
      Buffer.from('\0'), Buffer.from(step, 'utf8')]))
    .digest();
  return `fence-${digest.toString('base64url')}`;
}

/** `<hostname>-<pid>-<random>`, unique per process incarnation. */
export function defaultOwner() {
  const host = hostname().replace(/[^\x21-\x7e]/g, '-').slice(0, 200) || 'host';
  return `${host}-${process.pid}-${randomBytes(4).toString('hex')}`;
}

/** 43 base64url characters from 32 OS random bytes: the proof that a lease is ours. */
export function newLeaseKey() {
  return randomBytes(32).toString('base64url');
}

/** The monotonic clock, in milliseconds. */
export const now = () => performance.now();

/**
 * The safety margin of a grant: 10% of its TTL, at least 50 ms, unless configured.
 * @param {number} grantedMs
 * @param {number | undefined} marginMs
 */
export function marginOf(grantedMs, marginMs) {
  return marginMs ?? Math.max(Math.floor(grantedMs / 10), 50);
}

/**
 * `url` to quote in an error message: everything from its scheme's `//` (or its start) up to
 * its last '@' removed, so no user or password it carries is shown, whatever its syntax (the
 * '@' may follow a '/' of the password).
 * @param {string} url
 */
export function withoutUserinfo(url) {
  const at = url.lastIndexOf('@');
  if (at < 0) return url;
  const scheme = /^[A-Za-z][A-Za-z0-9+.-]*:\/\//.exec(url.slice(0, at));
  return (scheme ? scheme[0] : '') + url.slice(at + 1);
}

/** The longest one connection attempt may take while other servers are left to try (ms). */
const MAX_CONNECT_SHARE_MS = 2_000;

// Marks a ServerUnreachable for which no connection could be made: no request reached the
// server, so the next one may be asked.
const NO_CONNECTION = Symbol('no connection');

/**
 * One server of a list: its URL as given (no trailing '/'), for messages; where to connect.
 * @param {string} server
 */
function serverOf(server) {
  let url = null;
  try {
    url = new URL(server);
  } catch {
    // Not thrown as is: URL's own error carries the text it was given (its `input`).
  }
  if (url !== null ? url.protocol !== 'http:' && url.protocol !== 'https:' : !/^https?:\/\//i.test(server)) {
    throw new TypeError(`the server URL must start with http:// or https://, not ${withoutUserinfo(server)}`);
  }
  return { server, url };
}

/**
 * HTTP calls to a lease server, without blocking. Several servers that share one database
 * (`http://a:7700,http://b:7700`, as FENCE_SERVER may hold and `fence run` passes on) act as
 * one: a call goes to the one that answered last, and moves on to the next only when no
 * connection could be made to it (refused, unreachable, TLS handshake failed), never once a
 * request may have reached it, so no decision is ever asked of two servers (as the Rust client).
 */
export class Transport {
  /**
   * @param {{server?: string, authToken?: string, authTokenFile?: string, caFile?: string, timeoutMs?: number}} options
   */
  constructor(options) {
    const given = options.server ?? process.env.FENCE_SERVER ?? 'http://127.0.0.1:7700';
    const parsed = given.split(',').map((one) => serverOf(one.trim().replace(/\/+$/, '')));
    if (given.includes('@')) {
      // The server knows bearer secrets only: a user or password here is a mistake, and would
      // be quoted in every error message (this.server is).
      throw new TypeError("the server URL must not carry a user or password ('@'): give the bearer secret as authToken (or authTokenFile, FENCE_AUTH_TOKEN)");
    }
    for (const { server, url } of parsed) {
      if (url === null) throw new TypeError(`the server URL ${server} is not a URL`);
    }
    this.server = parsed.map((p) => p.server).join(',');
    this.timeoutMs = options.timeoutMs ?? 10_000;
    if (options.authToken != null && options.authTokenFile != null) {
      throw new TypeError('give authToken or authTokenFile, not both');
    }
    let secret = options.authToken;
    let source = 'authToken';
    if (options.authTokenFile != null) {
      secret = readFileSync(options.authTokenFile, 'utf8').trim();
      if (!secret) throw new TypeError(`the auth token file ${options.authTokenFile} is empty`);
      source = `the auth token file ${options.authTokenFile}`;
    }
    if (secret == null) [secret, source] = [process.env.FENCE_AUTH_TOKEN, 'FENCE_AUTH_TOKEN'];
    // A secret read from an environment variable or a file often ends in a newline: white
    // space around it is no part of it. What is left goes in a header, so it must be visible
    // ASCII; the error never repeats it. An empty one is none (process.env.X ?? '' passed
    // on), as it always was.
    if (secret) {
      secret = String(secret).trim();
      if (!secret) throw new TypeError(`the bearer secret (${source}) is only white space`);
      if (!/^[\x21-\x7e]+$/.test(secret)) {
        throw new TypeError(`the bearer secret (${source}) holds a character an HTTP header cannot carry (a space, a control character or non-ASCII); it is not shown here`);
      }
    }
    this.headers = { accept: 'application/json' };
    if (secret) this.headers.authorization = `Bearer ${secret}`;
    const caFile = options.caFile ?? (process.env.FENCE_CA_CERT || undefined);
    const secure = parsed.some(({ url }) => url.protocol === 'https:');
    this.agents = { 'http:': new http.Agent({ keepAlive: true }) };
    // With a CA file, its certificates replace the system roots (as curl --cacert does).
    if (secure) this.agents['https:'] = new https.Agent({ keepAlive: true, ...(caFile ? { ca: readFileSync(caFile) } : {}) });
    this.servers = parsed.map(({ server, url }) => ({
      server,
      module: url.protocol === 'https:' ? https : http,
      agent: this.agents[url.protocol],
      target: { protocol: url.protocol, hostname: url.hostname.replace(/^\[|\]$/g, ''), port: url.port },
      base: url.pathname.replace(/\/+$/, ''),
    }));
    this.preferred = 0; // the index of the server that answered last
  }

  /**
   * One request: the decoded JSON answer on 2xx, else the problem as an error.
   * @param {string} method
   * @param {string} path
   * @param {object} [body]
   * @param {number} [timeoutMs]
   * @param {AbortSignal} [signal] cancels the call (its request is destroyed, its timer cleared)
   * @returns {Promise<any>}
   */
  async call(method, path, body, timeoutMs, signal) {
    const data = body === undefined ? undefined : Buffer.from(stringifyJson(body));
    const headers = { ...this.headers };
    if (data) {
      headers['content-type'] = 'application/json';
      headers['content-length'] = String(data.length);
    }
    const deadline = now() + Math.max(timeoutMs ?? this.timeoutMs, 1);
    const n = this.servers.length;
    const first = this.preferred % n;
    for (let tried = 0; ; tried++) {
      const i = (first + tried) % n;
      const last = tried + 1 >= n;
      const left = Math.max(deadline - now(), 1);
      // A silent server must not use up the call while others are left to try: its share of
      // what is left, at most 2 s; the last one may take it all.
      const connectWithin = last ? undefined : Math.min(left / (n - tried), MAX_CONNECT_SHARE_MS);
      try {
        const answer = await this.#once(this.servers[i], method, path, headers, data, left, connectWithin, signal);
        if (tried > 0) this.preferred = i;
        return answer;
      } catch (e) {
        // No connection was made, so no request reached this server: the next one may be
        // asked. Any other failure may have reached it: never.
        if (!e?.[NO_CONNECTION] || last || signal?.aborted || now() >= deadline) {
          if (!e?.[NO_CONNECTION] && tried > 0) this.preferred = i;
          throw e;
        }
      }
    }
  }

  #once(to, method, path, headers, data, wait, connectWithin, signal) {
    const what = `${method} ${to.server}${path}`;
    return new Promise((resolve, reject) => {
      const req = to.module.request({ ...to.target, agent: to.agent, method, path: to.base + path, headers });
      const timer = setTimeout(() => req.destroy(new Error(`no answer within ${Math.round(wait)} ms`)), wait);
      // Whether a connection was made (TLS handshake included): until then, no request can
      // have reached the server.
      let connected = false;
      let connectTimer;
      req.on('socket', (socket) => {
        if (req.reusedSocket) {
          connected = true;
          return;
        }
        socket.once(to.target.protocol === 'https:' ? 'secureConnect' : 'connect', () => {
          connected = true;
          clearTimeout(connectTimer);
        });
        if (connectWithin !== undefined) {
          connectTimer = setTimeout(() => {
            if (!connected) req.destroy(new Error(`no connection within ${Math.round(connectWithin)} ms`));
          }, connectWithin);
        }
      });
      // A cancelled call keeps nothing alive: its request goes, and with it the timer.
      const cancel = () => req.destroy(new Error('cancelled'));
      if (signal?.aborted) cancel();
      else signal?.addEventListener('abort', cancel, { once: true });
      req.on('close', () => {
        clearTimeout(connectTimer);
        signal?.removeEventListener('abort', cancel);
      });
      req.on('error', (e) => {
        clearTimeout(timer);
        const unreachable = new ServerUnreachable(`${what}: ${e.message}`, { cause: e });
        if (!connected) unreachable[NO_CONNECTION] = true;
        reject(unreachable);
      });
      req.on('response', (res) => {
        const chunks = [];
        let size = 0;
        res.on('data', (c) => {
          size += c.length;
          chunks.push(c);
          if (size > MAX_ANSWER) {
            // No answer of the lease API is near this (a checkpoint is at most 64 KiB): a
            // server or proxy streaming more would only fill this process's memory.
            clearTimeout(timer);
            req.destroy();
            reject(new ProtocolError(`${what}: an answer larger than ${MAX_ANSWER} bytes`));
          }
        });
        res.on('error', (e) => {
          clearTimeout(timer);
          reject(new ServerUnreachable(`${what}: ${e.message}`, { cause: e }));
        });
        res.on('end', () => {
          clearTimeout(timer);
          // Whatever the answer holds, the call settles: nothing thrown here would reach the
          // caller (it would be an uncaught exception of the socket's event).
          try {
            const text = Buffer.concat(chunks).toString('utf8');
            const status = res.statusCode ?? 0;
            if (status < 200 || status > 299) {
              reject(problemError(status, res.headers['content-type'], text, res.headers['retry-after']));
              return;
            }
            let answer;
            try {
              answer = parseJson(text);
            } catch {
              answer = null;
            }
            // No cause: JSON.parse's SyntaxError quotes the text around the error point (an
            // echoed lease key's first characters, past any redaction). Redacted before it is
            // cut: a key cut short at the end would escape the redaction.
            if (answer === null || typeof answer !== 'object') {
              reject(new ProtocolError(`${what}: not a JSON object: ${redact(text).slice(0, 200)}`));
              return;
            }
            resolve(answer);
          } catch (e) {
            reject(new ProtocolError(`${what}: an answer this client cannot read: ${e}`, { cause: e }));
          }
        });
      });
      req.end(data);
    });
  }

  close() {
    for (const agent of Object.values(this.agents)) agent.destroy();
  }
}

/** The largest answer a call reads (bytes), as the Go client's. */
export const MAX_ANSWER = 1 << 20;

/**
 * (token, ttl_ms, expires_at_ms) of a lease answer for `generation`.
 * @param {string} job
 * @param {bigint} generation
 * @param {any} answer
 */
export function grantOf(job, generation, answer) {
  if (typeof answer.generation !== 'bigint' || answer.generation !== generation) {
    throw new ProtocolError(`the server granted generation ${answer.generation} of ${job}, expected ${generation}`);
  }
  let token = answer.token;
  if (token === undefined || token === null) {
    token = String(generation);
  } else if (typeof token !== 'string' || !token.startsWith(`${generation}.`)) {
    throw new ProtocolError(`the server signed token ${redact(stringifyJson(token)).slice(0, 200)} for generation ${generation}`);
  }
  if (!Number.isInteger(answer.ttl_ms) || !Number.isInteger(answer.expires_at_ms)) {
    throw new ProtocolError(`a lease answer without ttl_ms and expires_at_ms: ${redact(stringifyJson(answer)).slice(0, 200)}`);
  }
  // A TTL outside what a server grants (0.1 s to 24 h; 0 is malformed, not a grant too short
  // to hold), or an expiry no unsigned 64-bit integer holds: as the Rust client.
  if (answer.ttl_ms < 100 || answer.ttl_ms > 86_400_000) throw new ProtocolError(`a lease answer with ttl_ms ${answer.ttl_ms}`);
  if (answer.expires_at_ms < 0 || answer.expires_at_ms >= 2 ** 64) {
    throw new ProtocolError(`a lease answer with expires_at_ms ${answer.expires_at_ms}`);
  }
  return { token, ttlMs: answer.ttl_ms, expiresAtMs: answer.expires_at_ms };
}

/**
 * The checkpoint of a claim's answer, `{generation, data}` (generation a bigint), or null when
 * it has none; a ProtocolError when it is not an object with an unsigned 64-bit integer
 * `generation` and a text `data` (as the Rust client).
 * @param {string} job
 * @param {any} answer
 */
export function checkpointOf(job, answer) {
  const checkpoint = answer.checkpoint;
  if (checkpoint === undefined || checkpoint === null) return null;
  const { generation, data } = typeof checkpoint === 'object' ? checkpoint : {};
  if (typeof generation !== 'bigint' || generation < 0n || generation >= 2n ** 64n || typeof data !== 'string') {
    throw new ProtocolError(`a claim of ${job} was answered with checkpoint ${redact(stringifyJson(checkpoint)).slice(0, 200)}`);
  }
  return { generation, data };
}
