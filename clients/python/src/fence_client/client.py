"""The blocking client: claims a job and keeps the lease renewed in a background thread.

    client = Client("http://127.0.0.1:7700", ttl=10)
    with client.claim("invoice-42") as lease:        # completes on a clean exit
        try:
            raise_for_problem(session.post(url, data=..., auth=FenceAuth(lease), timeout=5))
        except (requests.RequestException, ProblemError):
            lease.abandon()  # a timeout, a 502 or 504 may land: not released, left to expire
            raise
    with client.claim_slot("exports", 3) as lease:  # one of 3 slots; released on exit
        session.post(url, data=..., auth=FenceAuth(lease))   # X-Fencing-Job: exports#2
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any, Dict, Optional, Tuple, Type

from ._errors import (FenceError, LeaseHeld, LeaseLost, ProblemError, ProtocolError,
                      ServerUnreachable)
from ._lease import (DEADLINE_PASSED, FINISHED, SLOT_BACKOFF_FIRST, SLOT_BACKOFF_MAX, ClientCore,
                     LeaseCore, check_grant, claim_path, crowded_pause, give_back, may_be_held,
                     slot_of, slot_retry_pause, take_grant, waiting_claim_gap)
from ._wire import Timeout, bounded, check_job, encode_job, margin_ms, monotonic


class Lease(LeaseCore):
    """A held lease, renewed every third of its TTL by a keeper thread until it is released,
    completed, abandoned or lost.

    ``lost`` is a :class:`threading.Event` set the moment the lease is lost: no later than the
    local deadline, also when the server stops answering. Used as a context manager, the
    lease completes on a clean exit (releases with ``on_success="release"``) and releases
    when the block raises; a lease lost inside the block raises :class:`LeaseLost` on exit. A
    lease the block abandoned (:meth:`abandon`) or lost (past its local deadline, no progress,
    a refused renewal) is neither released nor completed on exit, whether the block raises or
    not: it is left to expire, and the lock-delay applies.
    """

    lost: threading.Event

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lost = threading.Event()
        self._finished = threading.Event()
        self._keeper: Optional[threading.Thread] = None

    def _signal_lost(self) -> None:
        self.lost.set()

    def _start(self) -> None:
        self._keeper = threading.Thread(target=self._keep, name=f"fence-keeper {self.job}",
                                        daemon=True)
        self._keeper.start()

    def _keep(self) -> None:
        try:
            self._keep_renewing()
        except BaseException as e:  # noqa: BLE001 - a keeper that stops can keep nothing
            # The reason says what failed; nobody joins the thread to see it raised.
            self._declare_lost(f"the keeper stopped unexpectedly: {e!r}")

    def _keep_renewing(self) -> None:
        next_at: Optional[float] = self._sent + self._renew_every()
        while next_at is not None:
            deadline = self.deadline
            # Every wait ends at the deadline at the latest: loss fires on time.
            if self._finished.wait(max(0.0, min(next_at, deadline) - monotonic())):
                return
            if self.lost.is_set():
                return
            sent = monotonic()
            if sent >= deadline:
                return self._declare_lost(DEADLINE_PASSED)
            stalled = self._stalled(sent)
            if stalled is not None:
                return self._declare_lost(stalled)
            attempt = self._attempt_time(deadline - sent)
            try:
                answer = bounded(lambda: self._send_renew(attempt), attempt)
            except Timeout:
                if monotonic() >= deadline:
                    return self._declare_lost(DEADLINE_PASSED)
                next_at = self._after_renewal(sent, error=ServerUnreachable(
                    f"a renewal had no answer within {attempt:.3g} s"))
            except Exception as e:  # noqa: BLE001 - any failure is a renewal without an answer
                next_at = self._after_renewal(sent, error=e)
            else:
                next_at = self._after_renewal(sent, answer=answer)

    def save_checkpoint(self, data: str) -> Dict[str, Any]:
        """Saves ``data`` (text, up to the server's limit, 8 KiB by default) as the job's
        checkpoint under this lease; the next claim returns it. The record. Raises
        :class:`LeaseLost` without sending once the lease is lost, :class:`LeaseRefused` when
        the server says a newer holder exists (the lease is then lost), and
        :class:`ProblemError` 413 ``payload-too-large`` past the limit."""
        return self._send_checkpoint(data)

    def release(self) -> Dict[str, Any]:
        """Frees the job for another claim; the record (``state`` ``free``). Raises
        :class:`LeaseRefused` when the server no longer records this lease. A server that fails
        to answer (:class:`ServerUnreachable`, a 502, 503 or 504, a 408) is asked again until it
        could end the lease on its own (a minute at most); a retry that finds the earlier attempt
        applied returns the record it left. After :meth:`abandon`, or once the lease is lost here
        (past its local deadline, no progress, a refused renewal), raises :class:`LeaseLost`
        and sends nothing: the lease is left to expire, so the lock-delay applies."""
        return self._finish("release")

    def complete(self) -> Dict[str, Any]:
        """Marks the job done for good; the record (``state`` ``completed``). The server
        decides: :class:`LeaseRefused` (409 ``lease-lost``) when someone else took over.
        Completing a semaphore slot releases it: the server frees the slot (the record's
        ``state`` is ``free``) and it can be claimed again, at the next generation. After
        :meth:`abandon`, raises :class:`LeaseLost` and sends nothing, as :meth:`release`; after
        a loss here (the local deadline checked too), a plain job's completion is still sent
        (nobody can claim a completed job), a slot's raises :class:`LeaseLost` and sends
        nothing, as :meth:`release` (it would free the slot at once)."""
        return self._finish("complete")

    def abandon(self) -> None:
        """Stops renewing and lets the lease expire on the server; no request is sent. Inside
        ``with``, the exit then neither releases nor completes, whether the block raises or
        not (after a write whose effect may still land, the lock-delay must apply); a later
        :meth:`release` or :meth:`complete` raises :class:`LeaseLost` and sends nothing. Called
        again, or after a release or completion, it changes nothing."""
        self._mark_abandoned()
        self._stop()

    def _stop(self) -> None:
        self._finished.set()
        self._declare_lost(FINISHED)

    def _finish(self, action: str) -> Dict[str, Any]:
        self._begin_ending(action)  # LeaseLost after abandon, or a release after a loss
        self._stop()  # nothing is sent under this lease from now on, whatever the answer
        return self._send_finish(action)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if self._abandoned:
            return  # left to expire, so the lock-delay applies: nothing is sent
        if self.is_lost():
            # Neither completed (the work may be unfinished) nor released: a write cut by the
            # loss may still land, and a release would let the next holder in beside it at
            # once, skipping the lock-delay. Left to expire: nothing is sent.
            if exc_type is not None:
                return  # the block's own exception is what the caller must see
            raise LeaseLost(self.job, self.generation, self.loss_reason or DEADLINE_PASSED)
        if exc_type is not None:
            try:
                self.release()
            except FenceError:
                pass  # the block's own exception is what the caller must see
            return
        if self.on_success == "complete":
            self.complete()
        else:
            self.release()


class Client(ClientCore):
    """A client of one lease server, claiming under one owner name.

    ``ttl`` and ``wait`` are seconds. The bearer secret is ``auth_token``, or read from
    ``auth_token_file``, or ``FENCE_AUTH_TOKEN``; ``ca_file`` (or ``FENCE_CA_CERT``) replaces
    the system roots for an ``https://`` server. ``margin`` overrides the safety margin (10%
    of the TTL, at least 50 ms); ``timeout`` bounds calls other than claims and renewals (a
    claim may take what its lease could use, the TTL less the margin, plus its ``wait``; a
    renewal attempt, a renewal interval or half what is left of the lease, when longer:
    one that gets no answer is asked again).
    ``lock_delay`` (seconds) is the lock-delay of this client's leases: if one *expires*,
    nobody can claim its job until that long after its end (default: the server's).
    ``progress_within`` (seconds) binds renewals to progress: the keeper renews only while
    ``lease.progress()`` was called that recently (the claim counts); off by default.
    """

    def claim(self, job: str, *, wait: float = 0.0, ttl: Optional[float] = None,
              on_success: str = "complete", lock_delay: Optional[float] = None) -> Lease:
        """Claims ``job`` and starts its keeper. With ``wait`` (seconds) the server holds the
        claim while the job is held and answers the moment it frees (asked again every 60 s).

        ``lock_delay`` (seconds) overrides the client's lock-delay for this lease.

        Raises :class:`LeaseHeld` (still held when the wait ends; :class:`LockDelay`, one of
        them, while an expired lease's lock-delay runs), :class:`JobCompleted`,
        :class:`ServerUnreachable`, :class:`ProblemError` for other refusals, and
        :class:`InvalidJobId` (ValueError for a ``ttl`` no longer than the client's ``margin``)
        before sending anything. A 200 that does not follow the contract
        raises :class:`ProtocolError`: its grant is given back when the answer names its
        generation, else its key is kept for the next claim as after a lost answer."""
        check_job(job)
        ttl_ms = self._claim_ttl_ms(ttl)
        key = self._claim_key(job)
        body = self._claim_body(key, ttl_ms, lock_delay)
        budget = (ttl_ms - margin_ms(ttl_ms, self._margin)) / 1000
        wait_until = monotonic() + max(wait, 0.0)
        try:
            while True:
                chunk = min(wait_until - monotonic(), 60.0)
                chunk = chunk if chunk >= 0.001 else 0.0
                sent = monotonic()
                try:
                    answer = self._transport.call("POST", claim_path(job, chunk), body,
                                                  timeout=budget + chunk)
                    break
                except LeaseHeld:
                    if chunk <= 0 or monotonic() >= wait_until:
                        raise
                except ProtocolError as e:
                    # A 200 this client cannot read (not a JSON object, too large) may be a
                    # grant, which no release can name: the same key gets it back.
                    self._keep_unsettled(job, key, ttl_ms)
                    raise may_be_held(e, True) from e
                except FenceError as e:
                    crowded = crowded_pause(e, wait_until)
                    if crowded is None:
                        self._claim_failed(job, key, ttl_ms, e)
                        raise
                    time.sleep(crowded)
                    continue
                time.sleep(waiting_claim_gap(sent, wait_until))
        except BaseException as e:
            if not isinstance(e, FenceError):
                # The caller gave up mid-claim (a cancelled task, asyncio.wait_for, Ctrl-C) or
                # the claim failed unexpectedly: the request may have gone out and been
                # granted, so its key is kept for the next claim of the job, as after an
                # answer lost (FenceErrors were sorted above).
                self._keep_unsettled(job, key, ttl_ms)
            raise
        return self._lease_from(job, key, ttl_ms, on_success, sent, answer)

    def claim_slot(self, resource: str, slots: int, *, wait: float = 0.0,
                   ttl: Optional[float] = None, lock_delay: Optional[float] = None) -> Lease:
        """Claims one of the ``slots`` slots of semaphore ``resource`` (contract section 15) and
        starts its keeper. The lease is an ordinary one on the slot's job,
        ``<resource>#<slot>`` (``lease.job``; ``lease.resource``, ``lease.slot``): renew,
        release, complete, checkpoint and the fencing headers work on it as on any job's;
        completing a slot releases it (the server frees the slot, ``state`` ``free``). Used as
        a context manager it releases on exit, unless the block abandoned it or it was lost.

        The server never waits on a semaphore claim: with ``wait`` (seconds) the client asks
        again while every slot is taken, after pauses of 10 ms doubling up to 500 ms (shorter
        when the slot that frees first frees sooner), until ``wait`` is over. Each call claims
        under a lease key of its own: two calls hold two slots, even under one owner. Within
        ``wait``, a claim whose answer was lost (the server unreachable, a timeout; a 502, 503
        or 504 after its ``Retry-After``, at most 60 s) is asked again with the same key, so a
        grant that was lost comes back as that slot rather than a second one (extended from the
        retry's decision).

        Raises :class:`LeaseHeld` (every slot taken when the wait ends; its ``job`` is the
        slot that frees first; :class:`LockDelay` while that slot's lock-delay runs),
        :class:`SemaphoreSize` (slots of the resource are held under another number, its
        ``slots``), :class:`ServerUnreachable`, :class:`ProblemError` for other refusals, and
        before sending anything :class:`InvalidJobId` for a resource name that is not 1 to 251
        visible ASCII characters or holds ``#``, ValueError for ``slots`` outside 1 to 1000."""
        path, body, key, ttl_ms, budget = self._slot_claim(resource, slots, ttl, lock_delay)
        wait_until = monotonic() + max(wait, 0.0)
        backoff = SLOT_BACKOFF_FIRST
        while True:
            sent = monotonic()
            try:
                answer = self._transport.call("POST", path, body, timeout=budget)
                break
            except ProtocolError as e:
                raise may_be_held(e, False) from e
            except (ServerUnreachable, ProblemError) as e:  # LeaseHeld is a ProblemError
                pause = slot_retry_pause(e, backoff, wait_until - monotonic())
                if pause is None:
                    raise
                time.sleep(pause)
                backoff = min(backoff * 2, SLOT_BACKOFF_MAX)
        job, slot = slot_of(resource, slots, answer)
        return self._lease_from(job, key, ttl_ms, "release", sent, answer, (resource, slot))

    def _lease_from(self, job: str, key: str, ttl_ms: int, on_success: str, sent: float,
                    answer: Dict[str, Any], slot: Optional[Tuple[str, int]] = None) -> Lease:
        """The lease a claim sent at ``sent`` was granted, its keeper started. A 200 that
        does not follow the contract raises :class:`ProtocolError`, and the grant it may stand
        for is given back when the answer names its generation."""
        generation = self._granted_generation(job, key, ttl_ms, answer, plain=slot is None)
        lease = Lease(self._transport, job, self.owner, key, generation, ttl_ms, self._margin,
                      on_success, self.progress_within)
        if slot is not None:
            lease.resource, lease.slot = slot
        take_grant(lease, sent, answer)
        check_grant(lease, sent, self._margin)
        # A claim that waited long arrives with little time left: renew once, now, and count
        # the deadline from this send. (Usable time of the grant, which may be shorter than
        # what was asked.)
        usable = lease.deadline - sent
        if lease.deadline - monotonic() < usable * 2 / 3:
            sent = monotonic()
            try:
                lease._set_grant(sent, lease._send_renew(usable), first=True)
            except BaseException:
                give_back(lease)  # not renewed: not held for a known time
                raise
        if monotonic() >= lease.deadline:
            give_back(lease)
            raise ServerUnreachable(f"the lease on {job} was granted too late to be of use")
        lease._start()
        return lease

    def status(self, job: str) -> Dict[str, Any]:
        """The job's lease record: ``job``, ``owner``, ``generation``, ``state``,
        ``expires_in_ms``. Raises :class:`ProblemError` 404 ``unknown-job``."""
        return self._transport.call("GET", f"/v1/leases/{encode_job(job)}")
