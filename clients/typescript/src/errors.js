// The errors of the fence client: a lease lost locally, and problem+json answers.

import { parseJson, redact } from './json.js';

/** Base class of every error this package throws. */
export class FenceError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
  }
}

/**
 * A job id that is not 1 to 256 visible ASCII characters, or a semaphore's resource name that
 * is not 1 to 251 of them without '#'; nothing was sent.
 */
export class InvalidJobId extends FenceError {}

/** No answer from the lease server (refused, reset, timed out, TLS); the cause is `cause`. */
export class ServerUnreachable extends FenceError {}

/** An answer of the lease server that does not follow the contract. */
export class ProtocolError extends FenceError {}

/**
 * The server granted a lease no longer than the client's safety margin (its --max-ttl is below
 * the TTL asked for): it could not be held at all, and is given back at once. Lower the
 * client's margin or raise the server's maximum TTL.
 */
export class GrantTooShort extends FenceError {
  constructor(job, grantedMs, marginMs) {
    super(`job ${job}: the server granted a lease of ${grantedMs} ms, not longer than the safety margin of ${marginMs} ms, so it could not be held at all; lower the client's safety margin or raise the server's maximum TTL`);
    this.job = job;
    this.grantedMs = grantedMs;
    this.marginMs = marginMs;
  }
}

/**
 * The lease is lost: stop all work and effects on the job; nothing was sent. Thrown by
 * `lease.token`, `lease.headers()` and `lease.fetch` once the local deadline passed or the
 * server refused a renewal; `lease.signal` aborts with it. `err instanceof LeaseLost` also
 * holds for a `LeaseRefused` (the server's own 409 lease-lost / 403 lease-key-mismatch).
 */
export class LeaseLost extends FenceError {
  /**
   * `inFlight`: a fenced fetch was on its way when the lease was lost, and was aborted then.
   * It may have reached the destination (whose fence decides), so its outcome is unknown: a
   * newer holder retries the step with the same Idempotency-Key. False: nothing was sent.
   */
  constructor(job, generation, reason, inFlight = false) {
    super(`the lease on job ${job} (generation ${generation}) is lost: ${reason}`
      + (inFlight ? '; a request on its way was aborted, and may have reached the destination' : ''));
    this.job = job;
    this.generation = generation;
    this.reason = reason;
    this.inFlight = inFlight;
  }

  static [Symbol.hasInstance](value) {
    if (Function.prototype[Symbol.hasInstance].call(this, value)) return true;
    return this === LeaseLost && Function.prototype[Symbol.hasInstance].call(LeaseRefused, value);
  }
}

/**
 * A refusal answered as application/problem+json (RFC 9457): `type` (`urn:fence:...`),
 * `status`, `title`, `detail`, the whole object as `problem` (members such as `job`, `owner`,
 * `generation`, `highest`), and `retryAfter` (seconds) when the answer had `Retry-After`.
 */
export class ProblemError extends FenceError {
  constructor(problem, status, retryAfter = null) {
    // Each member taken only when it has its type: an answer's `{"toString": 0}` must not
    // throw here, in a socket's event handler.
    const text = (v) => (typeof v === 'string' ? v : '');
    const type = text(problem.type) || 'about:blank';
    const st = Number.isInteger(problem.status) ? problem.status : status;
    const detail = text(problem.detail);
    super(`${st} ${type}: ${detail}`);
    // Not enumerable: util.inspect (console.log of the error) and JSON.stringify leave it out,
    // and an answer that echoes the request holds the lease key.
    Object.defineProperty(this, 'problem', { value: problem, writable: true, configurable: true, enumerable: false });
    this.type = type;
    this.status = st;
    this.title = text(problem.title);
    this.detail = detail;
    this.retryAfter = retryAfter;
  }
}

/**
 * 409 urn:fence:lease-held: another owner holds the job (`problem.owner`, `problem.expires_in_ms`).
 * For a semaphore claim: every slot is taken, and `problem.job` is the slot that frees first.
 */
export class LeaseHeld extends ProblemError {}

/**
 * 409 urn:fence:lock-delay: the job's last lease expired and its lock-delay runs; nobody can
 * claim it for `problem.claimable_in_ms` (`problem.owner` and `problem.generation` are the
 * expired lease's). A LeaseHeld, so code that waits for a held job waits for this too.
 */
export class LockDelay extends LeaseHeld {}

/**
 * 409 urn:fence:semaphore-size: slots of the resource are in force (held or expired with their
 * holder, or revoked before their lease would have ended) under another number of slots;
 * `slots` is the number in force. The number of slots of a resource changes only while none
 * of its slots is in force: claim with `slots`, or later.
 */
export class SemaphoreSize extends ProblemError {
  constructor(problem, status, retryAfter) {
    super(problem, status, retryAfter);
    this.slots = Number.isInteger(problem.slots) ? problem.slots : 0;
  }
}

/** 410 urn:fence:job-completed: the job is done; do not run it. */
export class JobCompleted extends ProblemError {}

/** 409 urn:fence:lease-lost or 403 urn:fence:lease-key-mismatch: this lease is not ours any more. */
export class LeaseRefused extends ProblemError {
  constructor(problem, status, retryAfter) {
    super(problem, status, retryAfter);
    this.job = problem.job;
    this.generation = typeof problem.generation === 'bigint' ? problem.generation : 0n;
    this.reason = `the server refused it: ${this.type}: ${this.detail}`;
  }
}

/**
 * 409 urn:fence:stale-token or urn:fence:token-expired from a destination: a newer holder
 * exists; stop. One exception: a token-expired (`type`) while your lease still holds (not
 * lost) means the request waited past the end of the token it carried (a signing server
 * gives a new token at each renewal): send it again with the lease's current token.
 */
export class StaleToken extends ProblemError {}

const BY_TYPE = {
  'urn:fence:lease-held': LeaseHeld,
  'urn:fence:lock-delay': LockDelay,
  'urn:fence:job-completed': JobCompleted,
  'urn:fence:semaphore-size': SemaphoreSize,
  'urn:fence:lease-lost': LeaseRefused,
  'urn:fence:lease-key-mismatch': LeaseRefused,
  'urn:fence:stale-token': StaleToken,
  'urn:fence:token-expired': StaleToken,
};

/** The most of a `Retry-After` a client waits for (seconds); its own wait still applies. */
export const MAX_RETRY_AFTER = 60;

/**
 * The error of a non-2xx answer: its problem+json, or a problem made from the status.
 * @param {number} status
 * @param {string | null | undefined} contentType
 * @param {string} body
 * @param {string | null | undefined} retryAfter
 */
export function problemError(status, contentType, body, retryAfter) {
  let problem = null;
  if ((contentType ?? '').toLowerCase().includes('json')) {
    try {
      problem = parseJson(body);
    } catch {
      problem = null;
    }
  }
  if (problem === null || typeof problem !== 'object' || typeof problem.type !== 'string') {
    // Redacted before it is cut: a key cut short at the end would escape the redaction.
    problem = { type: 'about:blank', status, title: '', detail: redact(String(body).trim()).slice(0, 500) };
  }
  if (typeof problem.detail === 'string') problem.detail = redact(problem.detail);
  // Seconds, at most MAX_RETRY_AFTER: an HTTP-date, a negative or not-a-number value is no
  // answer (backoff decides), and a huge one no reason to wait for days (a timer past 2^31 ms
  // would fire at once).
  const seconds = retryAfter == null || retryAfter === '' ? NaN : Number(retryAfter);
  // Own members only: a `type` such as "toString" or "__proto__" names no class of ours.
  const Cls = Object.hasOwn(BY_TYPE, problem.type) ? BY_TYPE[problem.type] : ProblemError;
  return new Cls(problem, status, seconds >= 0 ? Math.min(seconds, MAX_RETRY_AFTER) : null);
}

/**
 * Throws the ProblemError of a fetch Response that is not 2xx (for a destination's 409
 * stale-token, a StaleToken); resolves on success. Reads the body of a failed response.
 * @param {Response} response
 */
export async function raiseForProblem(response) {
  if (response.status < 400) return;
  const body = await response.text();
  throw problemError(response.status, response.headers.get('content-type'), body,
    response.headers.get('retry-after'));
}
