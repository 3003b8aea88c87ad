// A held lease: its keeper renews it, and it knows the moment it can no longer be trusted.
//
// The local deadline is send time + granted TTL - margin on the monotonic clock
// (performance.now()), where send time is noted before the claim or renewal went out. The
// server's expires_at_ms never enters it, so an offset between this machine's wall clock and
// the server's changes nothing.

import { JobCompleted, LeaseLost, LeaseRefused, ProblemError, ProtocolError, ServerUnreachable } from './errors.js';
import { encodeJob, grantOf, idempotencyKey, marginOf, now } from './wire.js';

export const DEADLINE_PASSED = 'the local deadline passed before a renewal succeeded';
export const FINISHED = 'the lease was released, completed or abandoned';
// Why a release or completion asked for after abandon() fails: sending it would let the next
// holder in at once, while a write the abandon was for may still land.
export const ABANDONED = 'the lease was abandoned: it is left to expire on the server, so the lock-delay applies; nothing was sent';

/**
 * Why a release asked for once the lease is lost here fails: a write cut by the loss may still
 * land, and a release the server would take (nobody claimed the job since) lets the next holder
 * in at once, skipping the lock-delay, which only an expiry starts.
 * @param {string} reason
 */
export function leftToExpire(reason) {
  return `the lease was lost (${reason}): it is left to expire on the server, so the lock-delay applies; nothing was sent`;
}

const TIMED_OUT = Symbol('timed out');

// A release or completion the server failed to answer is sent again after a pause that starts
// here and doubles up to the cap (ms), until the server could end the lease on its own.
const FINISH_PAUSE_FIRST_MS = 100;
const FINISH_PAUSE_MAX_MS = 1000;
// ... and for a minute at most, whatever the lease has left.
const FINISH_RETRY_WINDOW_MS = 60_000;

export class Lease {
  #transport;
  #key;
  #askedTtlMs;
  #marginMs;
  #token = '';
  #deadline = 0;
  #sent = 0;
  #ttlMs = 0;
  #expiresAtMs = 0;
  #reason = null;
  // Why the last renewal got no grant (unreachable, a 401, a 503), until one does: a loss at
  // the deadline says it, so an operator sees a rotated secret, not a timeout.
  #renewalFailed = null;
  // Whether that failure was the server's answer (a 401, a 503): a later attempt that got none
  // (unreachable, or cut short by the deadline) does not replace it.
  #renewalAnswered = false;
  #controller = new AbortController();
  #finished = false;
  // abandon() was called (before any release or completion): nothing ends the lease at the
  // server, neither `client.run` nor a release by hand.
  #abandoned = false;
  // release() or complete() was called: a later abandon() changes nothing.
  #ending = false;
  #wake = null;
  /** @type {AbortController | null} the renewal in flight, cancelled when the lease is finished */
  #renewal = null;
  #keeper = null;
  #progressWithinMs;
  #resumed = null;
  #lastProgress = now(); // the claim counts as the first report

  /** @internal Made by Client.claim. */
  constructor(transport, job, owner, key, generation, askedTtlMs, marginMs, progressWithinMs) {
    this.#progressWithinMs = progressWithinMs;
    this.#transport = transport;
    this.job = job;
    this.owner = owner;
    this.generation = generation;
    /** A semaphore slot's lease: its resource and slot number (job is `<resource>#<slot>`). */
    this.resource = undefined;
    this.slot = undefined;
    this.#key = key;
    this.#askedTtlMs = askedTtlMs;
    this.#marginMs = marginMs;
    /** A fetch that stamps this lease's headers and throws LeaseLost instead of sending. */
    this.fetch = fencedFetch(this);
  }

  /** Aborts the moment the lease is lost (its reason a LeaseLost); pass it to your own work. */
  get signal() {
    return this.#controller.signal;
  }

  /**
   * The newest fencing token, exactly as the server returned it (a signing server's
   * `<generation>.<expires_at_ms>.<signature>`, else the generation in decimal). Throws
   * LeaseLost from the moment the lease is lost.
   */
  get token() {
    if (this.#reason === null && now() < this.#deadline) return this.#token;
    this.#declareLost(this.#reason ?? DEADLINE_PASSED);
    throw new LeaseLost(this.job, this.generation, this.#reason);
  }

  /**
   * Reports that the worker is making progress. With the client's `progressWithinMs`, the
   * keeper renews only while this was called that recently (the claim counts); a worker that
   * hangs then loses its lease, which expires at the server. Without it, this does nothing.
   */
  progress() {
    this.#lastProgress = now();
  }

  /**
   * The job's last checkpoint as the claim returned it, `{generation, data}` (the generation
   * whose holder saved it), or null: resume from it, not from the start.
   */
  get checkpoint() {
    return this.#resumed;
  }

  /** @internal */
  _resume(checkpoint) {
    this.#resumed = checkpoint ?? null;
  }

  /** @internal Made a semaphore slot's lease by Client.claimSlot. */
  _slotOf(resource, slot) {
    this.resource = resource;
    this.slot = slot;
  }

  /**
   * Saves `data` (text, up to the server's limit, 8 KiB by default) as the job's checkpoint
   * under this lease; the next claim returns it. Resolves to the record. Throws LeaseLost
   * without sending once the lease is lost; rejects with LeaseRefused when the server says a
   * newer holder exists (the lease is then lost), ProblemError 413 past the limit.
   * @param {string} data
   */
  async saveCheckpoint(data) {
    if (typeof data !== 'string') throw new TypeError('a checkpoint is text: base64-encode bytes');
    void this.token; // throws LeaseLost once the lease is lost here
    const body = { owner: this.owner, generation: this.generation, lease_key: this.#key, checkpoint: data };
    try {
      return await this.#transport.call('POST', this.#path('checkpoint'), body);
    } catch (e) {
      if (e instanceof LeaseRefused) this.#declareLost(`the server refused the checkpoint: ${e.message}`);
      throw e;
    }
  }

  /** X-Fencing-Job and X-Fencing-Token for a write; throws LeaseLost. */
  headers() {
    return { 'X-Fencing-Job': this.job, 'X-Fencing-Token': this.token };
  }

  /** Whether the lease is lost, the local deadline checked too. */
  isLost() {
    try {
      void this.token;
      return false;
    } catch (e) {
      if (e instanceof LeaseLost) return true;
      throw e;
    }
  }

  /** Why the lease was lost, once it is; else null. */
  get lossReason() {
    return this.#reason;
  }

  /** The local deadline on performance.now(): lost at this instant unless renewed before. */
  get deadline() {
    return this.#deadline;
  }

  /** The TTL the server granted last, in milliseconds. */
  get ttlMs() {
    return this.#ttlMs;
  }

  /** The server's expiry of the last grant, on the server's clock (informational only). */
  get expiresAtMs() {
    return this.#expiresAtMs;
  }

  /** The derived Idempotency-Key of a step of this job (contract section 11). */
  idempotencyKey(step) {
    return idempotencyKey(this.job, step);
  }

  /**
   * Frees the job for another claim; resolves to the record. LeaseRefused when not ours. After
   * `abandon()`, or once the lease is lost here (past its local deadline, no progress, a
   * refused renewal), rejects with LeaseLost and sends nothing: the lease is left to expire, so
   * the lock-delay applies.
   */
  release() {
    return this.#end('release');
  }

  /**
   * Marks the job done for good; the server decides (LeaseRefused when someone took over).
   * Completing a semaphore slot releases it: the server frees the slot (the record's `state` is
   * 'free') and it can be claimed again, at the next generation. After `abandon()`, rejects with
   * LeaseLost and sends nothing, as release() does; after a loss here (the local deadline checked
   * too) a plain job's completion is still sent (nobody can claim a completed job), while a
   * slot's rejects with LeaseLost and sends nothing, as release() (it would free the slot at once).
   */
  complete() {
    return this.#end('complete');
  }

  /**
   * Stops renewing and lets the lease expire on the server; nothing is sent. In `client.run`,
   * the lease is then neither released nor completed when the callback ends, however it ends,
   * and a later release() or complete() rejects with LeaseLost, nothing sent. Called again, or
   * after a release or completion, it changes nothing.
   */
  abandon() {
    if (!this.#ending) this.#abandoned = true;
    this.#stop();
  }

  /** @internal Whether `abandon()` was called: `client.run` then sends nothing at the end. */
  get _abandoned() {
    return this.#abandoned;
  }

  #stop() {
    this.#finished = true;
    this.#wake?.();
    // A renewal still under way is of no use now: cancelled, it keeps no timer (and so
    // no process) alive until the lease's deadline.
    this.#renewal?.abort();
    this.#declareLost(FINISHED);
  }

  // A release or completion asked for by hand: LeaseLost, nothing sent, after abandon(), and for
  // a release, or a semaphore slot's completion (the server frees the slot: a release), once the
  // lease is lost here. A `finally { await lease.release(); }` after an abandon or a loss would
  // let the next holder in at once, skipping the lock-delay, while a write may still land. A
  // plain job's completion after a loss is still sent (nobody can claim a completed job). The
  // local deadline is checked for both actions first, and a loss it finds is recorded, never
  // hidden as "finished": a release after a completion that failed past the deadline is refused
  // too. A release after a release or completion asked for while held is sent again, as before.
  async #end(action) {
    if (this.#abandoned) throw new LeaseLost(this.job, this.generation, ABANDONED);
    const lost = this.isLost() && this.#reason !== FINISHED; // records a deadline passed unseen
    if (lost && (action === 'release' || this.slot !== undefined)) {
      throw new LeaseLost(this.job, this.generation, leftToExpire(this.#reason));
    }
    this.#ending = true;
    return this.#finish(action);
  }

  // A server that fails to answer (unreachable, a timeout, a 502, 503 or 504, a gateway's 408)
  // or did not get the request whole in time (its own 408 body-timeout: nothing applied) is asked
  // again until it could end the lease on its own (a minute at most): a passing blip at the end of a job must not leave
  // it to expire and run again. A retry refused with lease-lost at this generation, by nobody
  // (released) or by this owner (completed: the only refusal that leaves both in place), finds
  // the earlier attempt applied: the record it left is returned.
  async #finish(action) {
    this.#stop(); // nothing is sent under this lease from now on, whatever the answer
    const body = { owner: this.owner, generation: this.generation, lease_key: this.#key };
    const until = Math.min(this.#sent + this.#ttlMs, now() + FINISH_RETRY_WINDOW_MS);
    let pauseMs = FINISH_PAUSE_FIRST_MS;
    let unsure = false;
    for (;;) {
      try {
        return await this.#transport.call('POST', this.#path(action), body);
      } catch (e) {
        if (e instanceof LeaseRefused) {
          const holder = e.problem.owner ?? null;
          if (!unsure || e.status !== 409 || e.generation !== this.generation || (holder !== null && holder !== this.owner)) throw e;
          return { job: this.job, owner: holder, generation: this.generation, state: holder === null ? 'free' : 'completed', expires_in_ms: 0 };
        }
        const lost = answerLost(e);
        if (!(lost || busy(e)) || now() + pauseMs >= until) throw e;
        unsure ||= lost;
        await new Promise((resolve) => setTimeout(resolve, pauseMs));
        pauseMs = Math.min(pauseMs * 2, FINISH_PAUSE_MAX_MS);
      }
    }
  }

  /**
   * @internal Releases, in the background, a grant the client will not use (too short, come too
   * late, not renewed after a wait, or malformed): no request carried its token, and the next worker need
   * not wait for its expiry. A release that fails leaves it to expire.
   */
  _giveBack(sent) {
    // A grant whose answer could not be taken (malformed) set no TTL: the release is then
    // asked again within the TTL the claim sent at `sent` asked for.
    if (this.#ttlMs === 0 && sent !== undefined) {
      this.#sent = sent;
      this.#ttlMs = this.#askedTtlMs;
    }
    this.#finish('release').catch(() => {});
  }

  /** @internal One renewal; the keeper calls it, tests replace it to pause renewals. */
  _sendRenew(timeoutMs, signal) {
    const body = { owner: this.owner, generation: this.generation, lease_key: this.#key, ttl_ms: this.#askedTtlMs };
    return this.#transport.call('POST', this.#path('renew'), body, timeoutMs, signal);
  }

  /** @internal Takes a claim's or renewal's answer sent at `sent`; false when lost before. */
  _setGrant(sent, answer, first = false) {
    const { token, ttlMs, expiresAtMs } = grantOf(this.job, this.generation, answer);
    if (!first && (this.#reason !== null || now() >= this.#deadline)) return false; // loss is final
    this.#token = token;
    this.#ttlMs = ttlMs;
    this.#expiresAtMs = expiresAtMs;
    this.#sent = sent;
    // Never counted from more than was asked: a server (or something posing as one) that
    // grants more cannot move the deadline past what the worker asked to hold.
    const heldMs = Math.min(ttlMs, this.#askedTtlMs);
    this.#deadline = sent + Math.max(heldMs - marginOf(heldMs, this.#marginMs), 0);
    this.#renewalFailed = null;
    this.#renewalAnswered = false;
    return true;
  }

  /** @internal */
  _start() {
    // A bug in the keeper must not leave the lease looking held.
    this.#keeper = this.#keep().catch((e) => this.#declareLost(`the keeper failed: ${e}`));
  }

  /** The one place a lease is declared lost. Final: nothing un-loses it. */
  #declareLost(reason) {
    if (this.#reason === null) {
      this.#reason = reason === DEADLINE_PASSED && this.#renewalFailed !== null
        ? `${DEADLINE_PASSED} (the last renewal failed: ${this.#renewalFailed})`
        : reason;
    }
    if (!this.#controller.signal.aborted) {
      this.#controller.abort(new LeaseLost(this.job, this.generation, this.#reason));
    }
  }

  #path(action) {
    return `/v1/leases/${encodeJob(this.job)}/${action}`;
  }

  // A third of the grant, but never later than halfway to the deadline: a fixed margin may
  // take most of a grant the server cut short (its --max-ttl).
  #renewEvery() {
    const heldMs = Math.min(this.#ttlMs, this.#askedTtlMs);
    const usable = Math.max(heldMs - marginOf(heldMs, this.#marginMs), 0);
    return Math.max(Math.min(heldMs / 3, usable / 2), 10);
  }

  // Sleeps until `at` (monotonic ms), or until the lease is finished.
  #sleepUntil(at) {
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.#wake = null;
        resolve();
      }, Math.max(at - now(), 0));
      this.#wake = () => {
        clearTimeout(timer);
        this.#wake = null;
        resolve();
      };
    });
  }

  // Renews every third of the TTL until lost or finished. Every wait, a hanging renewal's
  // included, ends at the deadline at the latest, so the signal aborts on time.
  async #keep() {
    let next = this.#sent + this.#renewEvery();
    for (;;) {
      const deadline = this.#deadline;
      await this.#sleepUntil(Math.min(next, deadline));
      if (this.#finished || this.#reason !== null) return;
      const sent = now();
      if (sent >= deadline) return this.#declareLost(DEADLINE_PASSED);
      if (this.#progressWithinMs !== undefined && sent - this.#lastProgress > this.#progressWithinMs) {
        return this.#declareLost(`the worker reported no progress for ${this.#progressWithinMs} ms; renewals stopped`);
      }
      // Each attempt has its own time (as the Rust client): a renewal interval, or half the
      // time left when longer, never past the deadline. A connection that takes the request
      // and never answers is then abandoned and the renewal asked again, not the lease lost.
      const left = deadline - sent;
      const attempt = Math.min(left, Math.max(this.#renewEvery(), left / 2));
      let timer;
      const renewal = new AbortController();
      this.#renewal = renewal;
      const outcome = await Promise.race([
        this._sendRenew(attempt, renewal.signal).then((answer) => ({ answer }), (error) => ({ error })),
        new Promise((resolve) => { timer = setTimeout(() => resolve(TIMED_OUT), Math.max(sent + attempt - now(), 0)); }),
        new Promise((resolve) => renewal.signal.addEventListener('abort', () => resolve(FINISHED), { once: true })),
      ]);
      clearTimeout(timer);
      this.#renewal = null;
      if (this.#finished) return;
      if (outcome === TIMED_OUT) {
        if (now() >= deadline) return this.#declareLost(DEADLINE_PASSED);
        renewal.abort(); // the attempt under way is given up: its answer would change nothing
        next = this.#afterRenewal(sent, { error: new ServerUnreachable(`a renewal had no answer within ${Math.round(attempt)} ms`) });
        continue;
      }
      next = this.#afterRenewal(sent, outcome);
      if (next === null) return;
    }
  }

  // Applies a renewal's outcome: when to renew next, or null when the keeper is done.
  #afterRenewal(sent, { answer, error }) {
    if (error === undefined) {
      try {
        if (!this._setGrant(sent, answer)) {
          // The answer came after the deadline (or the lease was lost meanwhile): it changes
          // nothing, and the lease is lost, which must be signalled.
          this.#declareLost(DEADLINE_PASSED);
          return null;
        }
        return sent + this.#renewEvery();
      } catch (e) {
        if (!(e instanceof ProtocolError)) throw e;
        error = e;
      }
    }
    if (error instanceof LeaseRefused || error instanceof JobCompleted) {
      this.#declareLost(`the server refused the renewal: ${error.message}`);
      return null;
    }
    // No answer, or a refusal that decides nothing (503, 5xx, a secret the server does not
    // know): the deadline stands. Retry at a steady, jittered pace so the last chance before
    // the deadline is not skipped.
    const answered = !(error instanceof ServerUnreachable);
    if (answered || !this.#renewalAnswered) {
      this.#renewalFailed = String(error?.message ?? error).slice(0, 300);
      this.#renewalAnswered = answered;
    }
    const pause = Math.min(Math.max(this.#renewEvery() / 4, 10), 1000);
    return now() + pause * (0.8 + 0.2 * Math.random());
  }
}

/** The lease server's own 408: the request did not arrive whole in time, nothing was applied. */
const BODY_TIMEOUT = 'urn:fence:body-timeout';

/**
 * Whether `error` means the request may have been applied and its answer lost: the
 * server unreachable, a timeout, a 502, 503 or 504, or a 408 that is not the lease server's own
 * body-timeout (a gateway's: envoy answers 408 when the server sent no head in time, after it
 * forwarded the request).
 * @param {unknown} error
 */
export function answerLost(error) {
  if (error instanceof ServerUnreachable) return true;
  return error instanceof ProblemError
    && ([502, 503, 504].includes(error.status) || (error.status === 408 && error.type !== BODY_TIMEOUT));
}

/**
 * Whether `error` is the lease server's own 408 body-timeout: nothing was applied, and
 * asking again may pass (as the Rust client's StoreError::Busy).
 * @param {unknown} error
 */
export function busy(error) {
  return error instanceof ProblemError && error.status === 408 && error.type === BODY_TIMEOUT;
}

/** The statuses fetch follows as redirects. */
const REDIRECTS = new Set([301, 302, 303, 307, 308]);

/**
 * A fetch-compatible function that stamps the lease's X-Fencing-Job and X-Fencing-Token on
 * every request, read at the moment of the call, and rejects with LeaseLost instead of sending
 * once the lease is lost. A request still on its way when the lease is lost (connecting, in a
 * pool's queue, sending its body, waiting for the answer's head) is aborted then, with a
 * LeaseLost whose `inFlight` is true as the reason (it may have reached the destination: its
 * outcome is unknown); the answer's body, once its head has arrived, is left alone (read it
 * after a release too). Your own `signal` still applies. Redirects are followed here, not by fetch, so the lease is checked
 * again before each hop (fetch would re-send the stamped headers itself): as fetch does, at
 * most 20 hops, a 303 (or a 301/302 of a POST) becomes a GET without a body, and the
 * Authorization and Cookie headers are dropped when the origin changes. A body fetch cannot
 * send twice (a stream) is not re-sent: the redirect answer is returned as it came, and so it
 * is with `redirect: "manual"`; `redirect: "error"` rejects as fetch does.
 * @param {Lease} lease
 * @param {typeof fetch} [fetchImpl]
 * @returns {typeof fetch}
 */
export function fencedFetch(lease, fetchImpl = globalThis.fetch) {
  return async (input, init = {}) => {
    const fencing = lease.headers(); // rejects with LeaseLost: nothing is sent
    const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : undefined));
    for (const [name, value] of Object.entries(fencing)) headers.set(name, value);
    const mode = init.redirect ?? (input instanceof Request ? input.redirect : 'follow');
    const own = init.signal ?? (input instanceof Request ? input.signal : undefined);
    // Until the answer's head arrives, losing the lease aborts the request: a connect, a
    // pool's wait or a slow upload must not carry the token out after the deadline.
    const send = async (target, options) => {
      const untilAnswered = new AbortController();
      const lost = () => untilAnswered.abort(new LeaseLost(lease.job, lease.generation, lease.lossReason, true));
      lease.signal.addEventListener('abort', lost, { once: true });
      if (lease.signal.aborted) lost();
      // The caller's signal goes on applying to the answer's body, as it did before. Tied with
      // AbortSignal.any (Node 20.3 and later), which holds the combined signal weakly: a
      // listener added here by hand would stay on a long-lived caller's signal for good.
      const signal = own ? AbortSignal.any([own, untilAnswered.signal]) : untilAnswered.signal;
      try {
        return await fetchImpl(target, { ...options, signal });
      } finally {
        lease.signal.removeEventListener('abort', lost);
      }
    };
    let response = await send(input, { ...init, headers, redirect: 'manual' });
    if (mode === 'manual') return response;
    let url = new URL(input instanceof Request ? input.url : String(input));
    let method = (init.method ?? (input instanceof Request ? input.method : 'GET')).toUpperCase();
    let body = init.body;
    const replayable = (b) => b == null || typeof b === 'string' || b instanceof ArrayBuffer
      || ArrayBuffer.isView(b) || b instanceof URLSearchParams || b instanceof Blob || b instanceof FormData;
    for (let hops = 0; REDIRECTS.has(response.status) && response.headers.has('location'); hops += 1) {
      if (mode === 'error') throw new TypeError(`fetch failed: redirect (${response.status}) with redirect: "error"`);
      if (hops >= 20) throw new TypeError('fetch failed: more than 20 redirects');
      const next = new URL(response.headers.get('location'), url);
      if (response.status === 303 || ((response.status === 301 || response.status === 302) && method === 'POST')) {
        if (method !== 'HEAD') method = 'GET';
        body = undefined;
        for (const name of ['content-type', 'content-length', 'content-encoding', 'content-language', 'content-location']) headers.delete(name);
      } else if (!replayable(body) || (input instanceof Request && input.body != null && init.body === undefined)) {
        return response; // a body that cannot be sent again: the caller sees the redirect
      }
      if (next.origin !== url.origin) {
        headers.delete('authorization');
        headers.delete('cookie');
      }
      await response.body?.cancel();
      const again = lease.headers(); // rejects with LeaseLost: the redirect is not followed
      for (const [name, value] of Object.entries(again)) headers.set(name, value);
      url = next;
      response = await send(url, { ...init, method, body, headers, redirect: 'manual' });
    }
    return response;
  };
}

/**
 * A request body that checks the lease before each chunk goes out: once the lease is lost, the
 * stream errors with its LeaseLost and nothing more of `source` is sent (fetch then rejects,
 * and the destination sees a request cut short). Opt in with it for a body streamed through a
 * fetch that is not `fencedFetch` (which already aborts a request still sending its body at the
 * loss). `source` is an iterable or async iterable of Uint8Array or string chunks; pass the
 * result as `body` with `duplex: 'half'`.
 * @param {Lease} lease
 * @param {Iterable<Uint8Array | string> | AsyncIterable<Uint8Array | string>} source
 * @returns {ReadableStream<Uint8Array>}
 */
export function fencedBody(lease, source) {
  const chunks = source[Symbol.asyncIterator] ? source[Symbol.asyncIterator]() : source[Symbol.iterator]();
  const encoder = new TextEncoder();
  // highWaterMark 0: nothing is read ahead into the stream's queue, so pull runs only when fetch
  // asks for the next chunk and each chunk (and the end) is checked just before it is taken. With
  // the default of one queued chunk, a chunk checked before the loss could go out after it.
  return new ReadableStream({
    async pull(controller) {
      lease.headers(); // throws LeaseLost: the stream errors, nothing more is sent
      const { value, done } = await chunks.next();
      // A chunk that took its time may come after the loss: checked again, and dropped.
      lease.headers();
      if (done) controller.close();
      else controller.enqueue(typeof value === 'string' ? encoder.encode(value) : value);
    },
    async cancel(reason) {
      await chunks.return?.(reason);
    },
  }, { highWaterMark: 0 });
}
