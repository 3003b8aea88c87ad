"""What a held lease knows, shared by the thread and asyncio flavours: its newest token, its
local deadline, and the one place it is declared lost.

The deadline is *send time + granted TTL - margin* on the monotonic clock (the TTL asked for
when the server granted more), where send time is noted before the claim or renewal went out;
the server's ``expires_at_ms`` never enters it, so an offset between this machine's wall clock
and the server's changes nothing.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any, Dict, Optional, Tuple

from ._errors import (TOO_MANY_WAITERS, FenceError, GrantTooShort, JobCompleted, LeaseHeld,
                      LeaseLost, LeaseRefused, ProblemError, ProtocolError, ServerUnreachable,
                      answer_lost, busy)
from ._wire import (PathLike, Transport, check_job, check_resource, check_slots, checkpoint_of,
                    default_owner, encode_job, grant_token, idempotency_key, lock_delay_to_ms,
                    margin_ms, monotonic, new_lease_key, ttl_to_ms, wait_param)

DEADLINE_PASSED = "the local deadline passed before a renewal succeeded"
FINISHED = "the lease was released, completed or abandoned"
# Why a release or completion asked for after abandon() fails: sending it would let the next
# holder in at once, while a write the abandon was for may still land.
ABANDONED = ("the lease was abandoned: it is left to expire on the server, so the lock-delay "
             "applies; nothing was sent")


def left_to_expire(reason: str) -> str:
    """Why a release asked for once the lease is lost here fails: a write cut by the loss may
    still land, and a release the server would take (nobody claimed the job since) lets the
    next holder in at once, skipping the lock-delay, which only an expiry starts."""
    return (f"the lease was lost ({reason}): it is left to expire on the server, so the "
            "lock-delay applies; nothing was sent")


ON_SUCCESS = ("complete", "release")

# A semaphore claim is not held at the server: while every slot is taken, the client asks
# again after a pause that starts here and doubles up to the cap (seconds).
SLOT_BACKOFF_FIRST = 0.01
SLOT_BACKOFF_MAX = 0.5

# The least time between two sends of one waiting claim (seconds): a server that holds
# claims only briefly (its --max-claim-wait) is not asked round trip after round trip.
MIN_WAITING_CLAIM_GAP = 0.05

# A release or completion the server failed to answer is sent again after a pause that starts
# here and doubles up to the cap (seconds), until the server could end the lease on its own.
FINISH_PAUSE_FIRST = 0.1
FINISH_PAUSE_MAX = 1.0
# ... and for a minute at most, whatever the lease has left.
FINISH_RETRY_WINDOW = 60.0


def give_back(lease: "LeaseCore", sent: Optional[float] = None) -> None:
    """Releases, in the background, a grant this client will not use (too short, come too
    late, or malformed): no request carried its token, and the next worker need not wait for
    its expiry. A release that fails leaves it to expire.

    A grant whose answer could not be taken (malformed) set no TTL: the release is then asked
    again within the TTL the claim sent at ``sent`` asked for."""
    with lease._lock:
        if lease._ttl_ms == 0 and sent is not None:
            lease._sent, lease._ttl_ms = sent, lease._asked_ttl_ms

    def release() -> None:
        try:
            lease._send_finish("release")
        except Exception:  # noqa: BLE001 - best effort: it expires otherwise
            pass
    threading.Thread(target=release, name=f"fence-give-back-{lease.job}", daemon=True).start()


def check_grant(lease: "LeaseCore", sent: float, margin: Optional[float]) -> None:
    """Raises :class:`GrantTooShort` (the grant given back) when the grant of a claim sent at
    ``sent`` leaves no time before the safety margin."""
    if lease.deadline <= sent:
        give_back(lease)
        ttl_ms = lease._ttl_ms
        raise GrantTooShort(lease.job, ttl_ms / 1000, margin_ms(ttl_ms, margin) / 1000)


def may_be_held(error: ProtocolError, kept: bool) -> ProtocolError:
    """``error``, a claim's 200 that does not follow the contract, saying what it leaves: a
    grant no release can name (its generation, or a semaphore's slot, unknown), held until its
    TTL ends; with ``kept`` (a plain claim, whose key is kept), until the next claim of the job,
    asked with the same key, gets it back."""
    until = "its TTL ends"
    if kept:
        until += " or this client's next claim of the job (asked with the same key) gets it back"
    return ProtocolError(f"{error}; the lease it may stand for is held until {until}")


def granted_generation(job: str, answer: Dict[str, Any], kept: bool) -> int:
    """The generation a claim's answer grants, or :class:`ProtocolError` when it names none
    (the grant it may stand for cannot be given back: see :func:`may_be_held`)."""
    generation = answer.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise may_be_held(ProtocolError(f"a claim of {job} granted generation {generation!r}"),
                          kept)
    return generation


def take_grant(lease: "LeaseCore", sent: float, answer: Dict[str, Any]) -> None:
    """Takes the grant of a claim sent at ``sent``, and its checkpoint. A token, ttl_ms,
    expires_at_ms or checkpoint that is not the contract's raises :class:`ProtocolError`, the
    grant given back: a release names a lease by owner, generation and key, the generation the
    answer's and the others the claim's."""
    try:
        lease._set_grant(sent, answer, first=True)
        lease._resumed = checkpoint_of(lease.job, answer)
    except ProtocolError as e:
        give_back(lease, sent)
        raise ProtocolError(f"{e} (the grant of generation {lease.generation} is given back)") from e


def crowded_pause(error: BaseException, wait_until: float) -> Optional[float]:
    """How long a waiting claim refused 429 ``too-many-waiters`` (the server's waiting places
    full; the job was held) pauses before it asks again: its ``Retry-After`` (1 s without one),
    at least 50 ms, at most what is left of the wait. None when ``error`` is anything else or
    the wait is over (as the Rust client's ``claim_waiting``)."""
    left = wait_until - monotonic()
    if not (isinstance(error, ProblemError) and error.type == TOO_MANY_WAITERS) or left <= 0:
        return None
    after = 1.0 if error.retry_after is None else error.retry_after
    return min(max(after, MIN_WAITING_CLAIM_GAP), left)


def waiting_claim_gap(sent: float, wait_until: float) -> float:
    """How long a waiting claim sent at ``sent`` pauses before it asks again (seconds)."""
    return max(min(sent + MIN_WAITING_CLAIM_GAP, wait_until) - monotonic(), 0.0)


class LeaseCore:
    """The state of one lease; subclasses add the lost event and the keeper."""

    def __init__(self, transport: Transport, job: str, owner: str, key: str, generation: int,
                 asked_ttl_ms: int, margin: Optional[float], on_success: str,
                 progress_within: Optional[float] = None) -> None:
        if on_success not in ON_SUCCESS:
            raise ValueError(f"on_success is 'complete' or 'release', not {on_success!r}")
        self.job = job
        self.owner = owner
        self.generation = generation
        self.on_success = on_success
        self._transport = transport
        self._key = key
        self._asked_ttl_ms = asked_ttl_ms
        self._margin = margin
        self._lock = threading.RLock()
        self._token = ""
        self._deadline = 0.0
        self._sent = 0.0
        self._ttl_ms = 0
        self._expires_at_ms = 0
        self._reason: Optional[str] = None
        # Why the last renewal got no grant (unreachable, a 401, a 503), until one does: a
        # loss at the deadline says it, so an operator sees a rotated secret, not a timeout.
        self._renewal_failed: Optional[str] = None
        # Whether that failure was the server's answer (a 401, a 503): a later attempt that got
        # none (unreachable, or cut short by the deadline) does not replace it.
        self._renewal_answered = False
        self._progress_within = progress_within
        self._last_progress = monotonic()  # the claim counts as the first report
        # abandon() was called (before any release or completion): the lease is left to expire,
        # so nothing ends it at the server, neither a ``with`` exit nor a release by hand.
        self._abandoned = False
        # release() or complete() was called: a later abandon() changes nothing.
        self._ending = False
        self._resumed: Optional[Dict[str, Any]] = None
        # A semaphore slot's lease: its resource and slot number (job is "<resource>#<slot>").
        self.resource: Optional[str] = None
        self.slot: Optional[int] = None

    # -- what a worker reads -------------------------------------------------------------

    @property
    def token(self) -> str:
        """The newest fencing token, exactly as the server returned it (a signing server's
        ``<generation>.<expires_at_ms>.<signature>``, else the generation in decimal).

        Raises :class:`LeaseLost` from the moment the lease is lost: past the local deadline,
        after a refused renewal, after release or completion."""
        with self._lock:
            if self._reason is None and monotonic() < self._deadline:
                return self._token
            reason = self._reason or DEADLINE_PASSED
        self._declare_lost(reason)
        raise LeaseLost(self.job, self.generation, self._reason or reason)

    @property
    def checkpoint(self) -> Optional[Dict[str, Any]]:
        """The job's last checkpoint as the claim returned it, ``{"generation", "data"}`` (the
        generation whose holder saved it), or None: resume from it, not from the start."""
        return self._resumed

    def _send_checkpoint(self, data: str) -> Dict[str, Any]:
        """Saves ``data`` under this lease (blocking); a refusal ends the lease here too."""
        if not isinstance(data, str):
            raise TypeError("a checkpoint is text: base64-encode bytes")
        self.token  # raises LeaseLost without sending once the lease is lost here
        body = {"owner": self.owner, "generation": self.generation, "lease_key": self._key,
                "checkpoint": data}
        try:
            return self._transport.call("POST", self._path("checkpoint"), body)
        except LeaseRefused as e:
            self._declare_lost(f"the server refused the checkpoint: {e}")
            raise

    def progress(self) -> None:
        """Reports that the worker is making progress. With the client's ``progress_within``,
        the keeper renews only while this was called within that many seconds (the claim
        counts); a worker that hangs then loses its lease, which expires at the server.
        Without it, this does nothing."""
        with self._lock:
            self._last_progress = monotonic()

    def headers(self) -> Dict[str, str]:
        """``X-Fencing-Job`` and ``X-Fencing-Token`` for a write; raises :class:`LeaseLost`."""
        return {"X-Fencing-Job": self.job, "X-Fencing-Token": self.token}

    def is_lost(self) -> bool:
        """Whether the lease is lost, the local deadline checked too."""
        try:
            self.token
        except LeaseLost:
            return True
        return False

    @property
    def loss_reason(self) -> Optional[str]:
        """Why the lease was lost, once it is."""
        return self._reason

    @property
    def deadline(self) -> float:
        """The local deadline on ``time.monotonic()``: lost at this instant unless renewed."""
        with self._lock:
            return self._deadline

    @property
    def ttl(self) -> float:
        """The TTL the server granted last, in seconds."""
        with self._lock:
            return self._ttl_ms / 1000

    @property
    def expires_at_ms(self) -> int:
        """The server's expiry of the last grant, on the *server's* clock (informational: the
        client never uses it for its own deadline)."""
        with self._lock:
            return self._expires_at_ms

    def idempotency_key(self, step: str) -> str:
        """The derived ``Idempotency-Key`` of a step of this job (contract section 11)."""
        return idempotency_key(self.job, step)

    def __repr__(self) -> str:
        state = f"lost: {self._reason}" if self._reason else "held"
        return f"<{type(self).__name__} job={self.job!r} generation={self.generation} {state}>"

    # -- the keeper's half ---------------------------------------------------------------

    def _set_grant(self, sent: float, answer: Dict[str, Any], first: bool = False) -> bool:
        """Takes a claim's or renewal's answer sent at ``sent``; False when the lease was lost
        before it arrived (loss is final: a late answer changes nothing)."""
        token, ttl_ms, expires_at_ms = grant_token(self.job, self.generation, answer)
        with self._lock:
            if not first and (self._reason is not None or monotonic() >= self._deadline):
                return False
            self._token = token
            self._ttl_ms = ttl_ms
            self._expires_at_ms = expires_at_ms
            self._sent = sent
            # Never counted from more than was asked: a server (or something posing as one)
            # that grants more cannot move the deadline past what the worker asked to hold.
            held_ms = min(ttl_ms, self._asked_ttl_ms)
            self._deadline = sent + max(held_ms - margin_ms(held_ms, self._margin), 0) / 1000
            self._renewal_failed = None
            self._renewal_answered = False
        return True

    def _mark_abandoned(self) -> None:
        """Abandon's half: the lease is left to expire, unless a release or completion was
        asked for first (it then stays as that left it)."""
        with self._lock:
            if not self._ending:
                self._abandoned = True

    def _begin_ending(self, action: str) -> None:
        """Before a release or completion is sent: :class:`LeaseLost`, and nothing sent, once
        the lease was abandoned (:data:`ABANDONED`), and for a release, or a semaphore slot's
        completion (the server frees the slot: a release), once the lease is lost here (past
        its local deadline, no progress, a refused renewal: :func:`left_to_expire`). A
        ``finally: lease.release()`` after an abandon or a loss would otherwise let the next
        holder in at once, skipping the lock-delay, while a write may still land. A plain job's
        completion after a loss is still sent: nobody can claim a completed job. The deadline
        is checked for both actions and a loss it finds is kept (never hidden as "finished"),
        so a release after a completion that failed past the deadline is refused too. A
        release after a release or completion asked for while the lease was held is sent
        again, as before (the job may already be free)."""
        with self._lock:
            if self._abandoned:
                raise LeaseLost(self.job, self.generation, ABANDONED)
            if self._reason is None and monotonic() >= self._deadline:
                self._declare_lost(DEADLINE_PASSED)  # the keeper has not said it yet
            frees = action == "release" or self.slot is not None
            if frees and self._reason is not None and self._reason != FINISHED:
                raise LeaseLost(self.job, self.generation, left_to_expire(self._reason))
            self._ending = True
            # Ended here, under the lock: a loss the keeper declares from now on cannot come
            # between the check above and the release going out.
            if self._reason is None:
                self._reason = FINISHED

    def _stalled(self, now: float) -> Optional[str]:
        """Why the keeper must stop renewing, if the worker reported no progress in time."""
        with self._lock:
            within, last = self._progress_within, self._last_progress
        if within is not None and now - last > within:
            return f"the worker reported no progress for {within} s; renewals stopped"
        return None

    def _declare_lost(self, reason: str) -> None:
        """The one place a lease is declared lost. Final: nothing un-loses it."""
        with self._lock:
            if self._reason is None:
                if reason == DEADLINE_PASSED and self._renewal_failed is not None:
                    reason = f"{DEADLINE_PASSED} (the last renewal failed: {self._renewal_failed})"
                self._reason = reason
        self._signal_lost()

    def _signal_lost(self) -> None:
        raise NotImplementedError

    def _renew_every(self) -> float:
        # A third of the grant, but never later than halfway to the deadline: a fixed
        # margin may take most of a grant the server cut short (its --max-ttl).
        with self._lock:
            held_ms = min(self._ttl_ms, self._asked_ttl_ms)
            usable_ms = max(held_ms - margin_ms(held_ms, self._margin), 0)
            return max(min(held_ms / 3, usable_ms / 2), 10) / 1000

    def _attempt_time(self, left: float) -> float:
        """How long one renewal attempt may take when ``left`` seconds remain before the
        deadline: a renewal interval, or half the time left when longer, never past the
        deadline (as the Rust client). A connection that takes the request and never answers
        (a black-holed keep-alive, a stuck load balancer) is then abandoned and the renewal
        asked again, rather than using up the lease."""
        return max(min(left, max(self._renew_every(), left / 2)), 0.0)

    def _retry_pause(self) -> float:
        # Steady, so that the last chance before the deadline is not skipped; jittered, so
        # many workers do not all retry at once when a server comes back.
        pause = min(max(self._renew_every() / 4, 0.01), 1.0)
        return pause * random.uniform(0.8, 1.0)

    def _after_renewal(self, sent: float, answer: Optional[Dict[str, Any]] = None,
                       error: Optional[BaseException] = None) -> Optional[float]:
        """Applies a renewal's outcome: the monotonic time of the next renewal, or None when
        the keeper is done (lost, or the answer came after the deadline)."""
        if error is None and answer is not None:
            try:
                if not self._set_grant(sent, answer):
                    # The answer came after the deadline (or the lease was lost meanwhile):
                    # it changes nothing, and the lease is lost, which must be signalled.
                    self._declare_lost(DEADLINE_PASSED)
                    return None
                return sent + self._renew_every()
            except ProtocolError as e:
                error = e
        if isinstance(error, (LeaseRefused, JobCompleted)):
            self._declare_lost(f"the server refused the renewal: {error}")
            return None
        # No answer, or a refusal that decides nothing (503, 5xx, a secret the server does
        # not know): the deadline stands.
        answered = error is not None and not isinstance(error, ServerUnreachable)
        with self._lock:
            if answered or not self._renewal_answered:
                self._renewal_failed = str(error)[:300] if error is not None else "no answer"
                self._renewal_answered = answered
        return monotonic() + self._retry_pause()

    def _path(self, action: str) -> str:
        return f"/v1/leases/{encode_job(self.job)}/{action}"

    def _send_renew(self, timeout: float) -> Dict[str, Any]:
        """One renewal (blocking); the keeper calls it, tests replace it to pause renewals."""
        body = {"owner": self.owner, "generation": self.generation, "lease_key": self._key,
                "ttl_ms": self._asked_ttl_ms}
        return self._transport.call("POST", self._path("renew"), body, timeout=timeout)

    def _send_finish(self, action: str,
                     cancelled: Optional[threading.Event] = None) -> Dict[str, Any]:
        """Releases or completes. A server that fails to answer (unreachable, a timeout, a 502,
        503 or 504, a gateway's 408) or that did not get the request whole in time (its own 408
        ``body-timeout``: nothing applied) is asked again until it could end the lease on its
        own (a minute at most): a passing blip at the end of a job must not leave it to expire
        and run again. A retry refused with ``lease-lost`` at this generation, by nobody
        (released) or by this owner (completed: the only refusal that leaves both in place),
        finds the earlier attempt applied: the record it left is returned. Once ``cancelled``
        is set (the asyncio caller was cancelled), no further attempt is made: the last failure
        is raised."""
        body = {"owner": self.owner, "generation": self.generation, "lease_key": self._key}
        with self._lock:
            until = min(self._sent + self._ttl_ms / 1000, monotonic() + FINISH_RETRY_WINDOW)
        pause, unsure = FINISH_PAUSE_FIRST, False
        while True:
            try:
                return self._transport.call("POST", self._path(action), body)
            except LeaseRefused as e:
                holder = e.problem.get("owner")
                if not (unsure and e.status == 409 and e.generation == self.generation
                        and holder in (None, self.owner)):
                    raise
                return {"job": self.job, "owner": holder, "generation": self.generation,
                        "state": "free" if holder is None else "completed", "expires_in_ms": 0}
            except (ServerUnreachable, ProblemError) as e:
                lost = answer_lost(e)
                if not (lost or busy(e)) or monotonic() + pause >= until:
                    raise
                unsure = unsure or lost
                if cancelled is None:
                    time.sleep(pause)
                elif cancelled.wait(pause):
                    raise
                pause = min(pause * 2, FINISH_PAUSE_MAX)


def claim_path(job: str, wait_s: float) -> str:
    """The claim URL path of ``job``, waiting up to ``wait_s`` seconds (at most 60) at the server."""
    path = f"/v1/leases/{encode_job(job)}/claim"
    return path + (f"?wait={wait_param(wait_s)}" if wait_s > 0 else "")


def semaphore_claim_path(resource: str) -> str:
    """The claim URL path of a semaphore (no query: the server never waits on it)."""
    return f"/v1/semaphores/{encode_job(check_resource(resource))}/claim"


def slot_of(resource: str, slots: int, answer: Dict[str, Any]) -> Tuple[str, int]:
    """(job, slot) of a semaphore claim's answer, checked against what was asked."""
    job, slot = answer.get("job"), answer.get("slot")
    if (not isinstance(slot, int) or isinstance(slot, bool) or not 1 <= slot <= slots
            or job != f"{resource}#{slot}" or answer.get("resource") != resource):
        # Which slot's job the grant is on is not known, so no release can name it; a key is
        # not kept for a semaphore (each call claims under a key of its own).
        raise may_be_held(ProtocolError(f"a claim of semaphore {resource} ({slots} slots) was"
                                        f" answered with job {job!r}, slot {slot!r}"), False)
    return job, slot


def held_pause(error: LeaseHeld, backoff: float) -> float:
    """How long to pause before asking for a slot again: until the slot that frees first may be
    free (the problem's ``expires_in_ms``, or ``claimable_in_ms`` in a lock-delay), at most
    ``backoff`` seconds, at least a millisecond."""
    hint = error.problem.get("claimable_in_ms", error.problem.get("expires_in_ms"))
    pause = backoff
    if isinstance(hint, (int, float)) and not isinstance(hint, bool) and hint >= 0:
        pause = min(hint / 1000, backoff)
    return max(pause, 0.001)


def slot_retry_pause(error: FenceError, backoff: float, left: float) -> Optional[float]:
    """Seconds to pause before a semaphore claim is asked again (``left`` seconds of its wait
    remain), or None when ``error`` is to be raised.

    Every slot taken: after :func:`held_pause`. An answer lost (the server unreachable, a
    timeout, a 502, 503 or 504 of the server or a gateway) may have been a grant: asked again
    with the same key, which gets that slot back, extended from the retry's decision (contract
    section 4), rather than a second one; after ``backoff``, or the answer's ``Retry-After``
    when longer. Anything else, or no time
    left: raised."""
    if left <= 0:
        return None
    if isinstance(error, LeaseHeld):
        pause = held_pause(error, backoff)
    elif isinstance(error, ServerUnreachable):
        pause = backoff
    elif isinstance(error, ProblemError) and (answer_lost(error) or busy(error)):
        pause = max(backoff, error.retry_after or 0.0)
    else:
        return None
    return min(pause, left)


MAX_UNSETTLED = 10_000
"""The most lease keys of claims with lost answers a client keeps."""


class ClientCore:
    """The options both clients take, checked once: the server's transport, the owner, the
    TTL and the safety margin."""

    def __init__(self, server: Optional[str] = None, *, owner: Optional[str] = None,
                 ttl: float = 30.0, auth_token: Optional[str] = None,
                 auth_token_file: Optional[PathLike] = None, ca_file: Optional[PathLike] = None,
                 margin: Optional[float] = None, timeout: float = 10.0,
                 lock_delay: Optional[float] = None,
                 progress_within: Optional[float] = None) -> None:
        self._transport = Transport(server, auth_token, auth_token_file, ca_file, timeout)
        self.owner = check_job(owner) if owner is not None else default_owner()
        self.ttl_ms = ttl_to_ms(ttl)
        self.lock_delay_ms = lock_delay_to_ms(lock_delay)
        if progress_within is not None and not progress_within > 0:
            raise ValueError("progress_within must be above zero")
        self.progress_within = progress_within
        if margin is not None and not 0 <= margin * 1000 < self.ttl_ms:
            raise ValueError("the safety margin must be shorter than the TTL")
        self._margin = margin
        # Lease keys of claims whose answers were lost, by job: (key, monotonic time until
        # which a lease it won could still be held).
        self._unsettled: Dict[str, Tuple[str, float]] = {}
        self._unsettled_lock = threading.Lock()

    def _claim_ttl_ms(self, ttl: Optional[float]) -> int:
        """The TTL (ms) a claim asks for: ``ttl`` (seconds) if given, else the client's.
        ValueError, before anything is sent, for one no longer than the client's safety margin:
        such a lease could not be held at all (its claim would have no time to be answered)."""
        if ttl is None:
            return self.ttl_ms
        ttl_ms = ttl_to_ms(ttl)
        if margin_ms(ttl_ms, self._margin) >= ttl_ms:
            raise ValueError(f"a claim's TTL ({ttl!r} s) must be longer than the client's safety "
                             f"margin ({self._margin!r} s)")
        return ttl_ms

    def _claim_key(self, job: str) -> str:
        """The key for a claim of ``job``: the key of its last claim whose answer was lost,
        while a lease that claim may have won could still be held (asked again with it, the
        server gives that lease back instead of answering that the job is held, by this owner,
        until it expires); else a new one."""
        return self._claim_key_kept(job)[0]

    def _claim_key_kept(self, job: str) -> Tuple[str, Optional[float]]:
        """As :meth:`_claim_key`, with the time until which a kept key was kept (None for a
        new key), so that a claim that sent nothing can put it back as it was."""
        with self._unsettled_lock:
            kept = self._unsettled.pop(job, None)
        if kept is not None and monotonic() < kept[1]:
            return kept
        return new_lease_key(), None

    def _put_back_unsettled(self, job: str, key: str, until: Optional[float]) -> None:
        """Puts back a key taken by a claim of ``job`` that sent nothing (its wait for a
        place ended, or its caller gave up first): a kept key as it was, unless a claim since
        kept another; a new key not at all, since no lease can have been granted under it, and
        keeping it would take the place of a key a concurrent claim of the job kept."""
        if until is None:
            return
        with self._unsettled_lock:
            if job not in self._unsettled and len(self._unsettled) < MAX_UNSETTLED:
                self._unsettled[job] = (key, until)

    def _claim_failed(self, job: str, key: str, ttl_ms: int, error: BaseException) -> None:
        """Keeps ``key`` for the next claim of ``job`` when ``error`` means the claim's answer
        was lost (the server unreachable, a timeout, a 502, 503 or 504, a gateway's 408): it may
        have been a grant."""
        if answer_lost(error):
            self._keep_unsettled(job, key, ttl_ms)

    def _keep_unsettled(self, job: str, key: str, ttl_ms: int) -> None:
        """Keeps ``key`` for the next claim of ``job``, while a lease of ``ttl_ms`` it may
        have won could still be held: after an answer lost, or a 200 that does not follow the
        contract. At most MAX_UNSETTLED keys are kept; expired ones go first."""
        now = monotonic()
        with self._unsettled_lock:
            if len(self._unsettled) >= MAX_UNSETTLED:
                self._unsettled = {j: k for j, k in self._unsettled.items() if now < k[1]}
            if len(self._unsettled) < MAX_UNSETTLED:
                self._unsettled[job] = (key, now + ttl_ms / 1000)

    def _granted_generation(self, job: str, key: str, ttl_ms: int, answer: Dict[str, Any],
                            plain: bool) -> int:
        """The generation a claim's answer grants (see :func:`granted_generation`). When it
        names none, no release can name the grant: a plain claim's key is kept, so the next
        claim gets it back. Only then: a key kept beside a release could get the grant back
        before the release landed, which would then free the job under its new holder."""
        try:
            return granted_generation(job, answer, kept=plain)
        except ProtocolError:
            if plain:
                self._keep_unsettled(job, key, ttl_ms)
            raise

    def _claim_body(self, key: str, ttl_ms: int, lock_delay: Optional[float]) -> Dict[str, Any]:
        """A claim's body; the lock-delay of the call, else the client's, else the server's."""
        body: Dict[str, Any] = {"owner": self.owner, "lease_key": key, "ttl_ms": ttl_ms}
        delay_ms = lock_delay_to_ms(lock_delay) if lock_delay is not None else self.lock_delay_ms
        if delay_ms is not None:
            body["lock_delay_ms"] = delay_ms
        return body

    def _slot_claim(self, resource: str, slots: int, ttl: Optional[float],
                    lock_delay: Optional[float]) -> Tuple[str, Dict[str, Any], str, int, float]:
        """A semaphore claim's path, body, lease key, TTL (ms) and time budget per request
        (seconds); the resource and slots are checked here, before anything is sent."""
        path = semaphore_claim_path(resource)
        check_slots(slots)
        ttl_ms = self._claim_ttl_ms(ttl)
        key = new_lease_key()
        body = self._claim_body(key, ttl_ms, lock_delay)
        body["slots"] = slots
        budget = (ttl_ms - margin_ms(ttl_ms, self._margin)) / 1000
        return path, body, key, ttl_ms, budget

    @property
    def server(self) -> str:
        return self._transport.server
