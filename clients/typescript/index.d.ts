// Types of fence-client (hand-written; the package is plain JavaScript ESM).

export interface ClientOptions {
  /** The lease server's URL, or several of servers on one database separated by commas (a call moves to the next only when no connection could be made to one); default FENCE_SERVER, else http://127.0.0.1:7700. One with a user or password ('@') is refused (TypeError): give the bearer secret as `authToken`. */
  server?: string;
  /** The owner name to claim under; default `<hostname>-<pid>-<random>`. */
  owner?: string;
  /** The lease TTL asked for, 100 to 86,400,000 ms; default 30,000. */
  ttlMs?: number;
  /** The bearer secret; default read from `authTokenFile`, else FENCE_AUTH_TOKEN. */
  authToken?: string;
  /** A file holding the bearer secret (surrounding white space trimmed). */
  authTokenFile?: string;
  /** PEM certificates that replace the system roots for an https:// server; default FENCE_CA_CERT. */
  caFile?: string;
  /** The safety margin before the lease's end; default 10% of the granted TTL, at least 50 ms. */
  marginMs?: number;
  /** Bounds calls other than claims and renewals; default 10,000 ms. */
  timeoutMs?: number;
  /** Renew only while `lease.progress()` was called this recently (ms; the claim counts); default: unbound. */
  progressWithinMs?: number;
  /** Lock-delay of this client's leases, 0 to 86,400,000 ms: if one expires, nobody can claim its job until this long after its end. Default: the server's. */
  lockDelayMs?: number;
}

export interface ClaimOptions {
  /** Wait at the server up to this long while another owner holds the job (asked again every 60 s). */
  waitMs?: number;
  /** The TTL for this claim, instead of the client's; one no longer than the client's safety margin is refused (RangeError) before anything is sent. */
  ttlMs?: number;
  /** The lock-delay of this claim's lease, instead of the client's. */
  lockDelayMs?: number;
  /**
   * Gives the claim up when it aborts (as fetch's `signal`): the call rejects with `signal.reason` (an AbortError DOMException by default) at once, whether aborted before anything was sent, between attempts of a wait, or with a request under way (which is cut). A cut request may have been granted at the server: its lease key is kept for the next claim of the job, which gets that grant back. A grant whose answer was read after the abort is given back (released), no keeper started. Not an AbortSignal (nor undefined or null): TypeError before sending. In `run`, it applies to the claim only.
   */
  signal?: AbortSignal | null;
}

/** Options of Client.claimSlot. */
export interface ClaimSlotOptions {
  /** Ask again up to this long while every slot is taken (the server never waits on a semaphore claim): after pauses of 10 ms doubling up to 500 ms, shorter when the slot that frees first frees sooner. Within it, a claim whose answer was lost (ServerUnreachable, a timeout, a 502, 503 or 504 after its Retry-After, at most 60 s) is asked again with the same key: a lost grant comes back as that slot, not a second one. */
  waitMs?: number;
  /** The TTL for this claim, instead of the client's; one no longer than the client's safety margin is refused (RangeError) before anything is sent. */
  ttlMs?: number;
  /** The lock-delay of this claim's lease, instead of the client's. */
  lockDelayMs?: number;
  /** Gives the claim up when it aborts, as ClaimOptions.signal: rejects with `signal.reason` at once (a backoff pause ended, a request under way cut); a grant whose answer was read after the abort is given back. No key is kept for a semaphore: a slot claim cut under way that the server had granted holds its slot until its TTL ends. Not an AbortSignal (nor undefined or null): TypeError before sending. */
  signal?: AbortSignal | null;
}

export interface RunOptions extends ClaimOptions {
  /** What a resolved callback does to the job; default 'complete'. */
  onSuccess?: 'complete' | 'release';
}

/** A lease record (GET /v1/leases/{job}, release, complete). */
export interface LeaseRecord {
  job: string;
  owner: string | null;
  generation: bigint;
  state: 'free' | 'held' | 'expired' | 'completed';
  expires_in_ms: number;
}

export class Client {
  constructor(options?: ClientOptions);
  readonly server: string;
  readonly owner: string;
  readonly ttlMs: number;
  readonly lockDelayMs: number | undefined;
  /** Claims `job` and starts its keeper. Rejects with LeaseHeld (LockDelay while an expired lease's lock-delay runs), JobCompleted, GrantTooShort (a grant no longer than the safety margin, given back), ProblemError, ServerUnreachable; throws InvalidJobId before sending. After a claim whose answer was lost (ServerUnreachable, a 502, 503 or 504, a gateway's 408), the next claim of the job asks with the same lease key, so a lost grant comes back. A 200 that does not follow the contract rejects with ProtocolError: the grant is given back when the answer names its generation, else its key is kept for the next claim as after a lost answer. With `signal`, rejects with its reason when it aborts (see ClaimOptions.signal). */
  claim(job: string, options?: ClaimOptions): Promise<Lease>;
  /**
   * Claims one of `slots` (1 to 1000) slots of semaphore `resource` and starts its keeper: a lease on the slot's job `<resource>#<slot>`, with `resource` and `slot` set. Release or complete it when done: completing a slot releases it (the server frees the slot; the record's `state` is 'free'), so once the lease is lost here neither is sent (LeaseLost).
   * Rejects with LeaseHeld (every slot taken when the wait ends; `problem.job` is the slot that frees first; LockDelay in its lock-delay), SemaphoreSize (held under another number of slots), ProblemError, ServerUnreachable; before sending, with InvalidJobId for a resource that is not 1 to 251 visible ASCII characters or holds '#', RangeError for slots outside 1 to 1000. With `signal`, rejects with its reason when it aborts (see ClaimSlotOptions.signal).
   */
  claimSlot(resource: string, slots: number, options?: ClaimSlotOptions): Promise<Lease>;
  /** Claims, runs `fn`, completes on success (or releases with onSuccess 'release'), releases on a throw; rejects with LeaseLost when the lease was lost meanwhile. A lease `fn` abandoned or lost (its local deadline, no progress, a refused renewal) is neither released nor completed, however `fn` ends: it is left to expire, so the lock-delay applies. */
  run<T>(job: string, fn: (lease: Lease) => Promise<T>, options?: RunOptions): Promise<T>;
  status(job: string): Promise<LeaseRecord>;
  /** Closes idle keep-alive connections to the server. */
  close(): void;
}

export class Lease {
  private constructor();
  readonly job: string;
  readonly owner: string;
  readonly generation: bigint;
  /** A semaphore slot's resource (`job` is `<resource>#<slot>`); undefined for a plain lease. */
  readonly resource: string | undefined;
  /** A semaphore slot's number, 1 to the number of slots; undefined for a plain lease. */
  readonly slot: number | undefined;
  /** Aborts the moment the lease is lost; its `reason` is a LeaseLost. */
  readonly signal: AbortSignal;
  /** The newest token as the server returned it; throws LeaseLost once the lease is lost. */
  readonly token: string;
  readonly lossReason: string | null;
  /** The local deadline on performance.now(). */
  readonly deadline: number;
  /** The TTL granted last, in ms. */
  readonly ttlMs: number;
  /** The server's expiry of the last grant, on the server's clock (informational only). */
  readonly expiresAtMs: number;
  /** A fetch that stamps X-Fencing-Job and X-Fencing-Token and throws LeaseLost instead of sending after loss; a request still awaiting its answer's head when the lease is lost is aborted with it. */
  readonly fetch: typeof fetch;
  /** X-Fencing-Job and X-Fencing-Token; throws LeaseLost. */
  headers(): { 'X-Fencing-Job': string; 'X-Fencing-Token': string };
  isLost(): boolean;
  idempotencyKey(step: string): string;
  /** Frees the job; the record (LeaseRefused when not ours). A server that fails to answer (ServerUnreachable, a 502, 503 or 504, a gateway's 408) or answers its own 408 body-timeout (nothing applied) is asked again until it could end the lease on its own (a minute at most); a retry that finds the earlier attempt applied resolves to the record it left. After abandon(), or once the lease is lost here (its local deadline, no progress, a refused renewal), rejects with LeaseLost and sends nothing: the lease is left to expire, so the lock-delay applies. */
  release(): Promise<LeaseRecord>;
  /** Marks the job done (LeaseRefused when someone took over), retried as release() is. On a semaphore slot it releases the slot: the server frees it and the record's `state` is 'free'. After abandon(), rejects with LeaseLost and sends nothing, as release() does; after a loss here (the local deadline checked too) a plain job's completion is still sent (nobody can claim a completed job), while a slot's rejects with LeaseLost and sends nothing, as release() (it would free the slot at once). */
  complete(): Promise<LeaseRecord>;
  /** Stops renewing and lets the lease expire on the server; sends nothing. In `client.run`, the lease is then neither released nor completed when `fn` ends, and a later release() or complete() rejects with LeaseLost, nothing sent. Called again, or after a release or completion, it changes nothing. */
  abandon(): void;
  /** The job's last checkpoint as the claim returned it (the generation that saved it), or null. */
  readonly checkpoint: { generation: bigint; data: string } | null;
  /** Saves `data` as the job's checkpoint under this lease; LeaseLost/LeaseRefused once it is not ours. */
  saveCheckpoint(data: string): Promise<LeaseRecord>;
  /** Reports progress: with the client's progressWithinMs, the keeper renews only while this was called that recently. */
  progress(): void;
}

/** A fetch that stamps the lease's headers and throws LeaseLost instead of sending after loss; a request still awaiting its answer's head when the lease is lost is aborted with it. */
export function fencedFetch(lease: Lease, fetchImpl?: typeof fetch): typeof fetch;
/** A request body that checks the lease before each chunk goes out: once the lease is lost, the stream errors with its LeaseLost and nothing more of `source` is sent. For a body streamed through a fetch that is not `fencedFetch` (which already aborts an upload at the loss); pass it as `body` with `duplex: 'half'`. */
export function fencedBody(lease: Lease, source: Iterable<Uint8Array | string> | AsyncIterable<Uint8Array | string>): ReadableStream<Uint8Array>;

export function checkJob(job: string): string;
/** Percent-encodes every byte but A-Z a-z 0-9 - . _ ~; throws InvalidJobId. */
export function encodeJob(job: string): string;
/** The derived Idempotency-Key of a step of a job (contract section 11). */
export function idempotencyKey(job: string, step: string): string;

export class FenceError extends Error {}
export class InvalidJobId extends FenceError {}
export class ServerUnreachable extends FenceError {}
export class ProtocolError extends FenceError {}
/** The server granted a lease no longer than the client's safety margin (its --max-ttl below the TTL asked for): it could not be held at all, and is given back at once. */
export class GrantTooShort extends FenceError {
  constructor(job: string, grantedMs: number, marginMs: number);
  readonly job: string;
  readonly grantedMs: number;
  readonly marginMs: number;
}
/** The lease is lost; nothing was sent, unless `inFlight`. `instanceof LeaseLost` also holds for a LeaseRefused. */
export class LeaseLost extends FenceError {
  constructor(job: string, generation: bigint, reason: string, inFlight?: boolean);
  readonly job: string;
  readonly generation: bigint;
  readonly reason: string;
  /** A fenced fetch on its way when the lease was lost, aborted then: it may have reached the destination (outcome unknown). */
  readonly inFlight: boolean;
}
export interface Problem {
  type: string;
  status?: number;
  title?: string;
  detail?: string;
  [member: string]: unknown;
}
export class ProblemError extends FenceError {
  constructor(problem: Problem, status: number, retryAfter?: number | null);
  readonly problem: Problem;
  readonly type: string;
  readonly status: number;
  readonly title: string;
  readonly detail: string;
  readonly retryAfter: number | null;
}
export class LeaseHeld extends ProblemError {}
export class LockDelay extends LeaseHeld {}
/** 409 urn:fence:semaphore-size: slots of the resource are held under another number, `slots`. */
export class SemaphoreSize extends ProblemError {
  /** The number of slots in force. */
  readonly slots: number;
}
export class JobCompleted extends ProblemError {}
export class LeaseRefused extends ProblemError {
  readonly job: string;
  readonly generation: bigint;
  readonly reason: string;
}
/**
 * 409 urn:fence:stale-token or urn:fence:token-expired from a destination: a newer holder
 * exists; stop. One exception: a token-expired (`type`) while your lease still holds (not
 * lost) means the request waited past the end of the token it carried (a signing server
 * gives a new token at each renewal): send it again with the lease's current token.
 */
export class StaleToken extends ProblemError {}
export function problemError(status: number, contentType: string | null | undefined, body: string,
  retryAfter?: string | null): ProblemError;
/** Throws the ProblemError of a non-2xx fetch Response (a StaleToken for 409 stale-token). */
export function raiseForProblem(response: Response): Promise<void>;
