// A client for fence lease servers: claim a job, keep the lease renewed, and send the newest
// fencing token with every write, refusing to send once the lease is lost.
//
//   const client = new Client({ server: 'http://127.0.0.1:7700', ttlMs: 10_000 });
//   await client.run('invoice-42', async (lease) => {        // completes when fn resolves
//     await lease.fetch('http://127.0.0.1:7800/ledger', { method: 'POST', body: 'charge' });
//   });

import { LeaseHeld, LeaseLost, ProtocolError, ServerUnreachable } from './errors.js';
import { DEADLINE_PASSED, Lease } from './lease.js';
import { Transport, checkJob, defaultOwner, encodeJob, marginOf, newLeaseKey, now } from './wire.js';

export * from './errors.js';
export { Lease, fencedFetch } from './lease.js';
export { checkJob, encodeJob, idempotencyKey } from './wire.js';

function checkLockDelay(delayMs) {
  if (delayMs !== undefined && !(Number.isInteger(delayMs) && delayMs >= 0 && delayMs <= 86_400_000)) {
    throw new RangeError(`a lock-delay is 0 to 86400000 ms, not ${delayMs}`);
  }
  return delayMs;
}

function checkTtl(ttlMs) {
  if (!Number.isInteger(ttlMs) || ttlMs < 100 || ttlMs > 86_400_000) {
    throw new RangeError(`a lease TTL is 100 to 86400000 ms, not ${ttlMs}`);
  }
  return ttlMs;
}

/** A client of one lease server, claiming under one owner name. */
export class Client {
  #transport;

  /**
   * @param {import('../index.js').ClientOptions} [options]
   */
  constructor(options = {}) {
    this.#transport = new Transport(options);
    this.owner = options.owner !== undefined ? checkJob(options.owner) : defaultOwner();
    this.ttlMs = checkTtl(options.ttlMs ?? 30_000);
    if (options.marginMs !== undefined && !(options.marginMs >= 0 && options.marginMs < this.ttlMs)) {
      throw new RangeError('the safety margin must be shorter than the TTL');
    }
    this.marginMs = options.marginMs;
    this.lockDelayMs = checkLockDelay(options.lockDelayMs);
    if (options.progressWithinMs !== undefined && !(options.progressWithinMs > 0)) {
      throw new RangeError('progressWithinMs must be above zero');
    }
    this.progressWithinMs = options.progressWithinMs;
  }

  get server() {
    return this.#transport.server;
  }

  /**
   * Claims `job` and starts its keeper. With `waitMs` the server holds the claim while the job
   * is held and answers the moment it frees (asked again every 60 s).
   * @param {string} job
   * @param {{waitMs?: number, ttlMs?: number, lockDelayMs?: number}} [options]
   * @returns {Promise<Lease>}
   */
  async claim(job, options = {}) {
    checkJob(job);
    const ttlMs = checkTtl(options.ttlMs ?? this.ttlMs);
    const key = newLeaseKey();
    const body = { owner: this.owner, lease_key: key, ttl_ms: ttlMs };
    const lockDelayMs = checkLockDelay(options.lockDelayMs ?? this.lockDelayMs);
    if (lockDelayMs !== undefined) body.lock_delay_ms = lockDelayMs;
    const budget = ttlMs - marginOf(ttlMs, this.marginMs);
    const waitUntil = now() + Math.max(options.waitMs ?? 0, 0);
    let answer;
    let sent;
    for (;;) {
      let chunk = Math.min(waitUntil - now(), 60_000);
      chunk = chunk >= 1 ? Math.floor(chunk) : 0;
      const path = `/v1/leases/${encodeJob(job)}/claim${chunk > 0 ? `?wait=${chunk}ms` : ''}`;
      sent = now();
      try {
        answer = await this.#transport.call('POST', path, body, budget + chunk);
        break;
      } catch (e) {
        if (!(e instanceof LeaseHeld) || chunk === 0 || now() >= waitUntil) throw e;
      }
    }
    if (typeof answer.generation !== 'bigint' || answer.generation < 1n) {
      throw new ProtocolError(`a claim of ${job} granted generation ${answer.generation}`);
    }
    const lease = new Lease(this.#transport, job, this.owner, key, answer.generation, ttlMs, this.marginMs,
      this.progressWithinMs);
    lease._resume(answer.checkpoint);
    lease._setGrant(sent, answer, true);
    // A claim that waited long arrives with little time left: renew once, now, and count the
    // deadline from this send (against the grant, which may be shorter than asked).
    const usable = lease.deadline - sent;
    if (lease.deadline - now() < (usable * 2) / 3) {
      sent = now();
      lease._setGrant(sent, await lease._sendRenew(usable), true);
    }
    if (now() >= lease.deadline) {
      throw new ServerUnreachable(`the lease on ${job} was granted too late to be of use`);
    }
    lease._start();
    return lease;
  }

  /**
   * Claims `job`, runs `fn(lease)`, then completes the job when it resolves (releases with
   * `onSuccess: 'release'`) and releases it when it throws. A lease lost while `fn` ran is
   * released, not completed, and the call rejects with LeaseLost.
   * @template T
   * @param {string} job
   * @param {(lease: Lease) => Promise<T>} fn
   * @param {{waitMs?: number, ttlMs?: number, onSuccess?: 'complete' | 'release'}} [options]
   * @returns {Promise<T>}
   */
  async run(job, fn, options = {}) {
    const onSuccess = options.onSuccess ?? 'complete';
    if (onSuccess !== 'complete' && onSuccess !== 'release') {
      throw new TypeError(`onSuccess is 'complete' or 'release', not ${onSuccess}`);
    }
    const lease = await this.claim(job, options);
    let result;
    try {
      result = await fn(lease);
    } catch (e) {
      await lease.release().catch(() => {}); // the callback's own error is what counts
      throw e;
    }
    if (lease.isLost()) {
      const reason = lease.lossReason ?? DEADLINE_PASSED;
      await lease.release().catch(() => {}); // never complete a job whose lease was lost
      throw new LeaseLost(job, lease.generation, reason);
    }
    await (onSuccess === 'complete' ? lease.complete() : lease.release());
    return result;
  }

  /**
   * The job's lease record: job, owner, generation (bigint), state, expires_in_ms.
   * @param {string} job
   */
  async status(job) {
    return this.#transport.call('GET', `/v1/leases/${encodeJob(job)}`);
  }

  /** Closes idle keep-alive connections to the server. */
  close() {
    this.#transport.close();
  }
}
