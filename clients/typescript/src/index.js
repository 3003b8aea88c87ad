// A client for fence lease servers: claim a job, keep the lease renewed, and send the newest
// fencing token with every write, refusing to send once the lease is lost.
//
//   const client = new Client({ server: 'http://127.0.0.1:7700', ttlMs: 10_000 });
//   await client.run('invoice-42', async (lease) => {        // completes when fn resolves
//     try {
//       const res = await lease.fetch('http://127.0.0.1:7800/ledger', { method: 'POST', body: 'charge' });
//       await raiseForProblem(res); // a refused write (StaleToken on a 409) rejects: never completed
//     } catch (e) {
//       lease.abandon(); // a timeout, a 502 or 504 may land: not released, left to expire
//       throw e;
//     }
//   });
//   const slot = await client.claimSlot('exports', 3);         // one of 3 slots: job exports#2
//   try { /* lease.fetch(...) */ } finally { await slot.release(); }

import { GrantTooShort, LeaseHeld, LeaseLost, ProblemError, ProtocolError, ServerUnreachable } from './errors.js';
import { DEADLINE_PASSED, Lease, answerLost } from './lease.js';
import {
  Transport, checkJob, checkResource, checkSlots, checkpointOf, defaultOwner, encodeJob, marginOf, newLeaseKey, now,
} from './wire.js';

export * from './errors.js';
export { Lease, fencedBody, fencedFetch } from './lease.js';
export { checkJob, encodeJob, idempotencyKey } from './wire.js';

// A semaphore claim is not held at the server: while every slot is taken, the client asks again
// after a pause that starts here and doubles up to the cap (ms).
const SLOT_BACKOFF_FIRST_MS = 10;
const SLOT_BACKOFF_MAX_MS = 500;
// The least time between two sends of one waiting claim.
const MIN_WAITING_CLAIM_GAP_MS = 50;

/**
 * Resolves after `ms`; rejects with the signal's reason the moment `signal` aborts (its timer
 * cleared, so an abandoned claim keeps nothing alive).
 * @param {number} ms
 * @param {AbortSignal} [signal]
 */
function pause(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const done = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', done);
      resolve();
    }, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

/**
 * A claim's `signal` option: an AbortSignal, or none (undefined, or null as fetch takes it);
 * anything else a TypeError, before anything is sent.
 * @param {unknown} signal
 * @returns {AbortSignal | undefined}
 */
function checkSignal(signal) {
  if (signal === undefined || signal === null) return undefined;
  if (!(signal instanceof AbortSignal)) {
    throw new TypeError(`a claim's signal is an AbortSignal, not ${Object.prototype.toString.call(signal)}`);
  }
  return signal;
}

// The most lease keys of claims with lost answers a client keeps (see Client#unsettled).
const MAX_UNSETTLED = 10_000;

/**
 * How long to pause before asking for a slot again: until the slot that frees first may be free
 * (the problem's expires_in_ms, or claimable_in_ms in a lock-delay), at most `backoffMs`, at
 * least 1 ms.
 * @param {LeaseHeld} error
 * @param {number} backoffMs
 */
function heldPause(error, backoffMs) {
  const hint = error.problem.claimable_in_ms ?? error.problem.expires_in_ms;
  const ms = typeof hint === 'number' && hint >= 0 ? Math.min(hint, backoffMs) : backoffMs;
  return Math.max(ms, 1);
}

/**
 * `error`, a claim's 200 that does not follow the contract, saying what it leaves: a grant no
 * release can name (its generation, or a semaphore's slot, unknown), held until its TTL ends;
 * with `kept`, until the next claim of the job, asked with the same key, gets it back.
 * @param {ProtocolError} error
 * @param {boolean} kept
 */
function mayBeHeld(error, kept) {
  const until = kept ? "its TTL ends or this client's next claim of the job (asked with the same key) gets it back" : 'its TTL ends';
  return new ProtocolError(`${error.message}; the lease it may stand for is held until ${until}`, { cause: error });
}

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
  // Lease keys of claims whose answers were lost, by job: {key, until} (monotonic ms until
  // which a lease such a claim won could still be held). The next claim of the job asks with
  // it, so a lost grant comes back instead of the job being held, by this owner, until then.
  #unsettled = new Map();

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
   * is held and answers the moment it frees (asked again every 60 s). After a claim whose answer
   * was lost (ServerUnreachable, a 502, 503 or 504, a gateway's 408: it may have been granted), the next claim of
   * the job asks with the same lease key, so that grant comes back rather than the job being
   * held, by this owner, until it expires.
   *
   * With `signal`, the claim can be given up (a wait cut short, a request handler that gave
   * up): when it aborts, the call rejects with its reason at once, whether it was waiting
   * between attempts or had a request under way (which is cut). A request cut may have been
   * granted at the server, so its key is kept for the next claim of the job, as after a lost
   * answer; a grant whose answer was read after the abort is given back, no keeper started.
   * @param {string} job
   * @param {{waitMs?: number, ttlMs?: number, lockDelayMs?: number, signal?: AbortSignal}} [options]
   * @returns {Promise<Lease>}
   */
  async claim(job, options = {}) {
    checkJob(job);
    this.#claimTtl(options); // refused before the kept key is taken
    const signal = checkSignal(options.signal);
    signal?.throwIfAborted(); // nothing sent, and the kept key stays kept
    const kept = this.#unsettled.get(job);
    this.#unsettled.delete(job);
    const { key, body, ttlMs, budget } = this.#claimBody(options, kept !== undefined && now() < kept.until ? kept.key : undefined);
    const waitUntil = now() + Math.max(options.waitMs ?? 0, 0);
    let answer;
    let sent;
    for (;;) {
      signal?.throwIfAborted(); // after a refusal (LeaseHeld): nothing granted, no key to keep
      let chunk = Math.min(waitUntil - now(), 60_000);
      chunk = chunk >= 1 ? Math.floor(chunk) : 0;
      const path = `/v1/leases/${encodeJob(job)}/claim${chunk > 0 ? `?wait=${chunk}ms` : ''}`;
      sent = now();
      try {
        // The signal cuts the request (the transport's own timeout stands beside it).
        answer = await this.#transport.call('POST', path, body, budget + chunk, signal);
        break;
      } catch (e) {
        // A request cut by the signal fails as ServerUnreachable: it may have been granted
        // at the server, so its key is kept, as for any lost answer.
        if (answerLost(e)) this.#keepUnsettled(job, key, now() + ttlMs);
        if (e instanceof ProtocolError) {
          // A 200 this client cannot read (not a JSON object, too large) may be a grant, which
          // no release can name: the same key gets it back.
          this.#keepUnsettled(job, key, now() + ttlMs);
          if (signal?.aborted) throw signal.reason;
          throw mayBeHeld(e, true);
        }
        if (signal?.aborted) throw signal.reason;
        if (e instanceof ProblemError && e.type === 'urn:fence:too-many-waiters' && now() < waitUntil) {
          // The server's waiting places are full (the job was held): asked again after its
          // Retry-After (1 s without one), at least 50 ms, within the wait (as the Rust client).
          const after = Math.max((e.retryAfter ?? 1) * 1000, MIN_WAITING_CLAIM_GAP_MS);
          await pause(Math.min(after, waitUntil - now()), signal);
          continue;
        }
        if (!(e instanceof LeaseHeld) || chunk === 0 || now() >= waitUntil) throw e;
      }
      // A server that holds claims only briefly (its --max-claim-wait) would otherwise be asked
      // again at once, round trip after round trip: at most one claim per 50 ms.
      const gap = Math.min(sent + MIN_WAITING_CLAIM_GAP_MS - now(), waitUntil - now());
      if (gap > 0) await pause(gap, signal);
    }
    return this.#leaseFrom(job, key, ttlMs, sent, answer, undefined, signal);
  }

  /**
   * Claims one of the `slots` slots of semaphore `resource` (contract section 15) and starts its
   * keeper. The lease is an ordinary one on the slot's job, `<resource>#<slot>` (`lease.job`;
   * `lease.resource`, `lease.slot`): renew, release, complete, checkpoint and the fencing headers
   * work on it as on any job's. Release or complete it when done: completing a slot releases it
   * (the server frees the slot; the record's `state` is 'free').
   *
   * The server never waits on a semaphore claim: with `waitMs` the client asks again while every
   * slot is taken, after pauses of 10 ms doubling up to 500 ms (shorter when the slot that frees
   * first frees sooner), until `waitMs` is over. Each call claims under a lease key of its own:
   * two calls hold two slots, even under one owner. Within `waitMs`, a claim whose answer was
   * lost (ServerUnreachable, a timeout, a 502, 503 or 504 after its Retry-After) is asked again with the
   * same key, so a grant that was lost comes back as that slot rather than a second one
   * (extended from the retry's decision).
   *
   * Rejects with LeaseHeld (every slot taken when the wait ends; `problem.job` is the slot that
   * frees first; LockDelay while its lock-delay runs), SemaphoreSize (slots of the resource are
   * held under another number, its `slots`), ProblemError, ServerUnreachable; and before
   * sending anything with InvalidJobId for a resource name that is not 1 to 251 visible ASCII
   * characters or holds '#', RangeError for `slots` outside 1 to 1000.
   *
   * With `signal`, the claim can be given up as `claim`'s can: when it aborts, the call rejects
   * with its reason at once (a backoff pause ended, a request under way cut), and a grant whose
   * answer was read after the abort is given back. A slot claim cut under way may have been
   * granted at the server: no key is kept for a semaphore, so that slot is held until its TTL
   * ends.
   * @param {string} resource
   * @param {number} slots
   * @param {{waitMs?: number, ttlMs?: number, lockDelayMs?: number, signal?: AbortSignal}} [options]
   * @returns {Promise<Lease>}
   */
  async claimSlot(resource, slots, options = {}) {
    const path = `/v1/semaphores/${encodeJob(checkResource(resource))}/claim`;
    checkSlots(slots);
    const { key, body, ttlMs, budget } = this.#claimBody(options);
    const signal = checkSignal(options.signal);
    signal?.throwIfAborted();
    body.slots = slots;
    const waitUntil = now() + Math.max(options.waitMs ?? 0, 0);
    let backoff = SLOT_BACKOFF_FIRST_MS;
    let answer;
    let sent;
    for (;;) {
      sent = now();
      try {
        answer = await this.#transport.call('POST', path, body, budget, signal);
        break;
      } catch (e) {
        if (signal?.aborted) throw signal.reason;
        const left = waitUntil - now();
        let wait;
        if (e instanceof LeaseHeld) {
          wait = heldPause(e, backoff);
        } else if (answerLost(e)) {
          // The answer was lost, and it may have been a grant: the same key gets that slot
          // back, after the answer's Retry-After when it had a longer one.
          wait = Math.max(backoff, (e instanceof ProblemError ? e.retryAfter ?? 0 : 0) * 1000);
        }
        if (e instanceof ProtocolError) throw mayBeHeld(e, false);
        if (wait === undefined || left <= 0) throw e;
        await pause(Math.min(wait, left), signal);
        backoff = Math.min(backoff * 2, SLOT_BACKOFF_MAX_MS);
      }
    }
    const { job, slot } = answer;
    if (!Number.isInteger(slot) || slot < 1 || slot > slots || job !== `${resource}#${slot}` || answer.resource !== resource) {
      // Which slot's job the grant is on is not known, so no release can name it; a key is
      // not kept for a semaphore (each call claims under a key of its own).
      const error = mayBeHeld(new ProtocolError(`a claim of semaphore ${resource} (${slots} slots) was answered with job ${job}, slot ${slot}`), false);
      throw signal?.aborted ? signal.reason : error;
    }
    return this.#leaseFrom(job, key, ttlMs, sent, answer, { resource, slot }, signal);
  }

  // A claim's lease key, body, TTL and time budget per request (ms); the options checked here.
  // Keeps `key` for the next claim of `job` until `until`; past MAX_UNSETTLED keys, expired
  // ones go first, then new ones are not kept.
  #keepUnsettled(job, key, until) {
    if (this.#unsettled.size >= MAX_UNSETTLED) {
      const t = now();
      for (const [j, k] of this.#unsettled) if (k.until <= t) this.#unsettled.delete(j);
    }
    if (this.#unsettled.size < MAX_UNSETTLED) this.#unsettled.set(job, { key, until });
  }

  // The TTL a claim asks for: its own or the client's. A RangeError, before anything is sent,
  // for one no longer than the client's safety margin: such a lease could not be held at all
  // (its claim would have no time to be answered).
  #claimTtl(options) {
    const ttlMs = checkTtl(options.ttlMs ?? this.ttlMs);
    if (marginOf(ttlMs, this.marginMs) >= ttlMs) {
      throw new RangeError(`a claim's TTL (${ttlMs} ms) must be longer than the client's safety margin (${this.marginMs} ms)`);
    }
    return ttlMs;
  }

  #claimBody(options, key = newLeaseKey()) {
    const ttlMs = this.#claimTtl(options);
    const body = { owner: this.owner, lease_key: key, ttl_ms: ttlMs };
    const lockDelayMs = checkLockDelay(options.lockDelayMs ?? this.lockDelayMs);
    if (lockDelayMs !== undefined) body.lock_delay_ms = lockDelayMs;
    return { key, body, ttlMs, budget: ttlMs - marginOf(ttlMs, this.marginMs) };
  }

  // The lease a claim sent at `sent` was granted, its keeper started. A 200 that does not
  // follow the contract is a ProtocolError, and the grant it may stand for is given back when
  // the answer names its generation (a release needs it, with the owner and key sent). When
  // it names none, a plain claim's key is kept, so the next claim gets that lease back; not
  // both: a claim asked again with the key before the release landed would get the grant
  // back, and the release would then free the job under its new holder.
  //
  // A claim whose `signal` aborted rejects with its reason, whatever else befell the grant
  // (given back or its key kept as above); a grant that follows the contract is given back
  // (its answer read after the abort, or the abort during the renewal below), no keeper
  // started: nobody would hold the lease it kept.
  async #leaseFrom(job, key, ttlMs, sent, answer, slot, signal) {
    try {
      return await this.#grantedLease(job, key, ttlMs, sent, answer, slot, signal);
    } catch (e) {
      if (signal?.aborted) throw signal.reason;
      throw e;
    }
  }

  async #grantedLease(job, key, ttlMs, sent, answer, slot, signal) {
    if (typeof answer.generation !== 'bigint' || answer.generation < 1n) {
      if (slot === undefined) this.#keepUnsettled(job, key, now() + ttlMs);
      throw mayBeHeld(new ProtocolError(`a claim of ${job} granted generation ${answer.generation}`), slot === undefined);
    }
    const lease = new Lease(this.#transport, job, this.owner, key, answer.generation, ttlMs, this.marginMs,
      this.progressWithinMs);
    if (slot !== undefined) lease._slotOf(slot.resource, slot.slot);
    try {
      lease._setGrant(sent, answer, true);
      lease._resume(checkpointOf(job, answer));
    } catch (e) {
      lease._giveBack(sent); // a token, ttl_ms, expires_at_ms or checkpoint that is not the contract's
      if (!(e instanceof ProtocolError)) throw e;
      throw new ProtocolError(`${e.message} (the grant of generation ${answer.generation} is given back)`, { cause: e });
    }
    if (lease.deadline <= sent) {
      lease._giveBack();
      throw new GrantTooShort(job, lease.ttlMs, marginOf(lease.ttlMs, this.marginMs));
    }
    // A claim that waited long arrives with little time left: renew once, now, and count the
    // deadline from this send (against the grant, which may be shorter than asked).
    const usable = lease.deadline - sent;
    if (!signal?.aborted && lease.deadline - now() < (usable * 2) / 3) {
      sent = now();
      try {
        lease._setGrant(sent, await lease._sendRenew(usable, signal), true);
      } catch (e) {
        lease._giveBack(); // not renewed: not held for a known time
        throw e;
      }
    }
    if (signal?.aborted) {
      lease._giveBack(); // the claim was given up: nobody would hold this lease
      throw signal.reason;
    }
    if (now() >= lease.deadline) {
      lease._giveBack();
      throw new ServerUnreachable(`the lease on ${job} was granted too late to be of use`);
    }
    lease._start();
    return lease;
  }

  /**
   * Claims `job`, runs `fn(lease)`, then completes the job when it resolves (releases with
   * `onSuccess: 'release'`) and releases it when it throws. A lease lost while `fn` ran (past its
   * local deadline, no progress, a refused renewal) is neither released nor completed, and the
   * call rejects with LeaseLost (or `fn`'s own error). A lease `fn` abandoned (`lease.abandon()`)
   * is neither released nor completed either, whether `fn` resolves or throws. Either way it is
   * left to expire, so the server's lock-delay applies: a write may still land.
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
      // Abandoned or lost (a LeaseLost with inFlight among them): left to expire, so the
      // lock-delay applies, since the effect may still land. Else released; fn's error counts.
      if (!lease._abandoned && !lease.isLost()) await lease.release().catch(() => {});
      throw e;
    }
    if (lease._abandoned) return result; // left to expire: neither released nor completed
    if (lease.isLost()) {
      // Neither completed (the work may be unfinished) nor released (a write cut by the loss
      // may still land, and the next holder would be let in beside it at once): left to expire.
      throw new LeaseLost(job, lease.generation, lease.lossReason ?? DEADLINE_PASSED);
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
