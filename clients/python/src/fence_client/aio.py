"""The asyncio twin of :mod:`fence_client.client`: the same names, awaited.

    client = AsyncClient("http://127.0.0.1:7700", ttl=10)
    async with client.claim("invoice-42") as lease:     # completes on a clean exit
        try:
            r = await http.post(url, content=..., auth=FenceAuth(lease))  # fence_client.httpx
            raise_for_problem(r)                        # a refusal raises: never completed
        except (httpx.HTTPError, ProblemError):
            lease.abandon()  # a timeout, a 502 or 504 may land: not released, left to expire
            raise
    async with client.claim_slot("exports", 3) as lease:  # one of 3 slots; released on exit
        ...

The keeper is a task of the running loop; each call to the lease server runs the standard
library's HTTP client in a daemon thread of its own (not a pool: a renewal never queues behind
waiting claims or retried releases, nor behind the application's blocking work in the loop's
default executor), and every wait of the keeper is bounded by the local deadline, so
``lease.lost`` is set on time even while a renewal hangs. A call under way when the program
ends does not keep it alive.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from types import TracebackType
from typing import Any, Awaitable, Callable, Dict, Generator, Optional, Tuple, Type

from ._errors import (FenceError, LeaseHeld, LeaseLost, ProblemError, ProtocolError,
                      ServerUnreachable)
from ._lease import (DEADLINE_PASSED, FINISHED, SLOT_BACKOFF_FIRST, SLOT_BACKOFF_MAX, ClientCore,
                     LeaseCore, check_grant, claim_path, crowded_pause, give_back, may_be_held,
                     semaphore_claim_path, slot_of, slot_retry_pause, take_grant,
                     waiting_claim_gap)
from ._wire import check_job, check_slots, encode_job, margin_ms, monotonic


async def _in_thread(fn: Callable[..., Any], *args: Any,
                     then: Optional[Callable[[], None]] = None) -> Any:
    """``fn(*args)`` in a daemon thread of its own, awaited, in the caller's context (its
    context variables: a tracer's span, as ``asyncio.to_thread`` keeps them); ``then()`` is
    called in the loop once the thread has ended, even when the caller was cancelled before.

    A thread per call, never a pool: a call never queues behind another, so renewals cannot
    wait while waiting claims (held at the server for up to a minute) or retried releases take
    every thread, and nothing is shared with the loop's default executor, which the
    application's blocking work may fill. Daemon threads: a call still under way when the
    program ends (its caller cancelled, the loop closed) does not keep the process alive.
    Nor does a forked child inherit a pool whose threads it does not have."""
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()
    context = contextvars.copy_context()

    def settle(ok: bool, outcome: Any) -> None:
        if then is not None:
            then()
        if future.done():  # the caller was cancelled: nobody wants the outcome
            return
        if ok:
            future.set_result(outcome)
        else:
            future.set_exception(outcome)

    def run() -> None:
        try:
            ok, outcome = True, context.run(fn, *args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            ok, outcome = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody awaits the call any more

    try:
        threading.Thread(target=run, name="fence-call", daemon=True).start()
    except RuntimeError:  # the thread could not be started: it will not give its place back
        if then is not None:
            then()
        raise
    return await future


class AsyncLease(LeaseCore):
    """A held lease renewed by a task; ``lost`` is an :class:`asyncio.Event`. ``async with``
    completes on a clean exit (releases with ``on_success="release"``), releases on an
    exception, and raises :class:`LeaseLost` on exit when the lease was lost inside. A lease
    the block abandoned or lost is neither released nor completed on exit: it is left to
    expire."""

    lost: asyncio.Event

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop = asyncio.get_running_loop()
        self.lost = asyncio.Event()
        self._finished = asyncio.Event()
        self._keeper: Optional["asyncio.Task[None]"] = None

    def _signal_lost(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self.lost.set()
        elif not self._loop.is_closed():
            # Declared from another thread (a sync adapter used off the loop).
            self._loop.call_soon_threadsafe(self.lost.set)

    def _start(self) -> None:
        self._keeper = self._loop.create_task(self._keep(), name=f"fence-keeper {self.job}")

    async def _keep(self) -> None:
        try:
            await self._keep_renewing()
        except asyncio.CancelledError:
            self._declare_lost("the keeper was cancelled (its event loop is ending)")
            raise
        except Exception as e:  # noqa: BLE001 - a keeper that stops can keep nothing
            # The reason says what failed; nobody awaits the task to see it raised.
            self._declare_lost(f"the keeper stopped unexpectedly: {e!r}")

    async def _keep_renewing(self) -> None:
        next_at: Optional[float] = self._sent + self._renew_every()
        while next_at is not None:
            deadline = self.deadline
            try:
                await asyncio.wait_for(self._finished.wait(),
                                       max(0.0, min(next_at, deadline) - monotonic()))
                return
            except asyncio.TimeoutError:
                pass
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
                answer = await asyncio.wait_for(self._renew(attempt), attempt)
            except asyncio.TimeoutError:
                if monotonic() >= deadline:
                    return self._declare_lost(DEADLINE_PASSED)
                next_at = self._after_renewal(sent, error=ServerUnreachable(
                    f"a renewal had no answer within {attempt:.3g} s"))
            except Exception as e:  # noqa: BLE001 - any failure is a renewal without an answer
                next_at = self._after_renewal(sent, error=e)
            else:
                next_at = self._after_renewal(sent, answer=answer)

    async def _renew(self, timeout: float) -> Dict[str, Any]:
        return await _in_thread(self._send_renew, timeout)

    async def save_checkpoint(self, data: str) -> Dict[str, Any]:
        """As :meth:`fence_client.Lease.save_checkpoint`."""
        return await _in_thread(self._send_checkpoint, data)

    async def release(self) -> Dict[str, Any]:
        """Frees the job; the record. :class:`LeaseRefused` when the lease is not ours. After
        :meth:`abandon`, or once the lease is lost here, :class:`LeaseLost` and nothing sent:
        the lock-delay applies."""
        return await self._finish("release")

    async def complete(self) -> Dict[str, Any]:
        """Marks the job done; the record. :class:`LeaseRefused` when someone took over.
        Completing a semaphore slot releases it (the server frees the slot: ``state`` ``free``).
        After :meth:`abandon`, :class:`LeaseLost` and nothing sent, as :meth:`release`; after a
        loss, still sent for a plain job, while a slot's raises :class:`LeaseLost`, nothing
        sent (it would free the slot at once)."""
        return await self._finish("complete")

    def abandon(self) -> None:
        """Stops renewing and lets the lease expire on the server; nothing is sent. Inside
        ``async with``, the exit then neither releases nor completes, and a later :meth:`release`
        or :meth:`complete` raises :class:`LeaseLost`, nothing sent. Called again, or after a
        release or completion, it changes nothing."""
        self._mark_abandoned()
        self._stop()

    def _stop(self) -> None:
        self._finished.set()
        self._declare_lost(FINISHED)

    async def _finish(self, action: str) -> Dict[str, Any]:
        self._begin_ending(action)  # LeaseLost after abandon, or a release after a loss
        self._stop()
        # Cancelling the caller cannot stop the thread's call under way, but it stops the
        # retries after it (they would otherwise go on for up to a minute, unseen).
        cancelled = threading.Event()
        try:
            return await _in_thread(self._send_finish, action, cancelled)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._abandoned:
            return  # left to expire, so the lock-delay applies: nothing is sent
        if self.is_lost():
            # Left to expire, nothing sent, as in Lease.__exit__: a release would skip the
            # lock-delay while a write cut by the loss may still land.
            if exc_type is not None:
                return
            raise LeaseLost(self.job, self.generation, self.loss_reason or DEADLINE_PASSED)
        if exc_type is not None:
            try:
                await self.release()
            except FenceError:
                pass
            return
        if self.on_success == "complete":
            await self.complete()
        else:
            await self.release()


class _Claim:
    """What ``AsyncClient.claim`` and ``claim_slot`` return: await it for the lease, or
    ``async with`` it."""

    def __init__(self, claim: Callable[[], Awaitable[AsyncLease]]) -> None:
        self._claim = claim
        self._lease: Optional[AsyncLease] = None

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._claim().__await__()

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self
        return self._lease

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        assert self._lease is not None
        await self._lease.__aexit__(exc_type, exc, tb)


class AsyncClient(ClientCore):
    """The asyncio twin of :class:`fence_client.Client`, with the same options, and
    ``max_calls``: how many claims and status reads of this client may be under way at once
    (64; each takes two threads while under way). Past it they wait for one to end, within
    their ``wait`` and at least the client's ``timeout`` (then :class:`ServerUnreachable`,
    nothing sent). Renewals,
    checkpoints, releases and completions of held leases never wait for this: a lease's
    keeper is never held up by claims waiting at the server."""

    def __init__(self, server: Optional[str] = None, *, max_calls: int = 64,
                 **options: Any) -> None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise ValueError("max_calls must be a whole number of at least 1")
        super().__init__(server, **options)
        self.max_calls = max_calls
        self._call_slots: Dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    async def _place(self, until: Optional[float] = None) -> Callable[[], None]:
        """Waits for one of the ``max_calls`` places for claims and status reads; returns what
        gives it back. The place is held until the call's thread ends, its caller cancelled or
        not. One set of places per event loop. Waits until ``until`` (monotonic), and at least
        the client's timeout; then raises :class:`ServerUnreachable`, nothing sent."""
        loop = asyncio.get_running_loop()
        places = self._call_slots.get(loop)
        if places is None:
            # A semaphore holds on to its loop: forget those of loops that have ended.
            for ended in [other for other in self._call_slots if other.is_closed()]:
                del self._call_slots[ended]
            places = self._call_slots[loop] = asyncio.Semaphore(self.max_calls)
        within = max(self._transport.timeout, (until or 0.0) - monotonic())
        # Not asyncio.wait_for: before Python 3.12 it can return the place when the caller is
        # cancelled in the same turn the place came, and the claim would go on unwanted.
        taking = asyncio.ensure_future(places.acquire())
        try:
            await asyncio.wait({taking}, timeout=within)
        except BaseException:
            if taking.done() and not taking.cancelled():
                places.release()  # taken just as the caller gave up: given back
            else:
                taking.cancel()
            raise
        if not taking.done():
            taking.cancel()
            raise ServerUnreachable(
                f"this client's {self.max_calls} places for claims and status reads stayed taken "
                f"for {within:.1f} s (max_calls): nothing was sent")
        return places.release

    def claim(self, job: str, *, wait: float = 0.0, ttl: Optional[float] = None,
              on_success: str = "complete", lock_delay: Optional[float] = None) -> _Claim:
        """``await client.claim(job)`` or ``async with client.claim(job) as lease``; as
        :meth:`fence_client.Client.claim`."""
        check_job(job)
        self._claim_ttl_ms(ttl)  # refused here, before anything is sent
        return _Claim(lambda: self._claim(job, wait, ttl, on_success, lock_delay))

    def claim_slot(self, resource: str, slots: int, *, wait: float = 0.0,
                   ttl: Optional[float] = None, lock_delay: Optional[float] = None) -> _Claim:
        """``await client.claim_slot(resource, slots)`` or ``async with
        client.claim_slot(resource, slots) as lease`` (released on exit unless abandoned or
        lost); as :meth:`fence_client.Client.claim_slot`."""
        semaphore_claim_path(resource)
        check_slots(slots)
        self._claim_ttl_ms(ttl)
        return _Claim(lambda: self._claim_slot(resource, slots, wait, ttl, lock_delay))

    async def _claim_slot(self, resource: str, slots: int, wait: float, ttl: Optional[float],
                          lock_delay: Optional[float]) -> AsyncLease:
        path, body, key, ttl_ms, budget = self._slot_claim(resource, slots, ttl, lock_delay)
        wait_until = monotonic() + max(wait, 0.0)
        backoff = SLOT_BACKOFF_FIRST
        while True:
            try:
                done = await self._place(wait_until)
                sent = monotonic()  # a claim's time counts from when it is sent
                answer = await _in_thread(self._transport.call, "POST", path, body, budget,
                                          then=done)
                break
            except ProtocolError as e:
                raise may_be_held(e, False) from e
            except (ServerUnreachable, ProblemError) as e:  # LeaseHeld is a ProblemError
                pause = slot_retry_pause(e, backoff, wait_until - monotonic())
                if pause is None:
                    raise
                await asyncio.sleep(pause)
                backoff = min(backoff * 2, SLOT_BACKOFF_MAX)
        job, slot = slot_of(resource, slots, answer)
        return await self._lease_from(job, key, ttl_ms, "release", sent, answer, (resource, slot))

    async def _claim(self, job: str, wait: float, ttl: Optional[float],
                     on_success: str, lock_delay: Optional[float] = None) -> AsyncLease:
        ttl_ms = self._claim_ttl_ms(ttl)
        key, kept_until = self._claim_key_kept(job)
        body = self._claim_body(key, ttl_ms, lock_delay)
        budget = (ttl_ms - margin_ms(ttl_ms, self._margin)) / 1000
        wait_until = monotonic() + max(wait, 0.0)
        asked = False  # whether a request of this claim went out
        placeless = False  # whether the claim ended waiting for a place, this turn unsent
        try:
            while True:
                try:
                    try:
                        done = await self._place(wait_until)
                    except BaseException:
                        placeless = True
                        raise
                    asked = True
                    # What is left of the wait once a place was had.
                    chunk = min(wait_until - monotonic(), 60.0)
                    chunk = chunk if chunk >= 0.001 else 0.0
                    sent = monotonic()
                    answer = await _in_thread(self._transport.call, "POST",
                                              claim_path(job, chunk), body, budget + chunk,
                                              then=done)
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
                    crowded = None if placeless else crowded_pause(e, wait_until)
                    if crowded is None:
                        if not placeless:
                            self._claim_failed(job, key, ttl_ms, e)
                        raise
                    await asyncio.sleep(crowded)
                    continue
                await asyncio.sleep(waiting_claim_gap(sent, wait_until))
        except BaseException as e:
            if placeless:
                # Nothing is unsettled: this turn sent nothing, and each earlier one was
                # answered held. A kept key nothing was sent with goes back as it was.
                if not asked:
                    self._put_back_unsettled(job, key, kept_until)
            elif not isinstance(e, FenceError):
                # The caller gave up mid-claim (a cancelled task, asyncio.wait_for, Ctrl-C) or
                # the claim failed unexpectedly: the request may have gone out and been
                # granted, so its key is kept for the next claim of the job, as after an
                # answer lost (FenceErrors were sorted above).
                self._keep_unsettled(job, key, ttl_ms)
            raise
        return await self._lease_from(job, key, ttl_ms, on_success, sent, answer)

    async def _lease_from(self, job: str, key: str, ttl_ms: int, on_success: str, sent: float,
                          answer: Dict[str, Any],
                          slot: Optional[Tuple[str, int]] = None) -> AsyncLease:
        """The lease a claim sent at ``sent`` was granted, its keeper started. A 200 that
        does not follow the contract raises :class:`ProtocolError`, and the grant it may stand
        for is given back when the answer names its generation."""
        generation = self._granted_generation(job, key, ttl_ms, answer, plain=slot is None)
        lease = AsyncLease(self._transport, job, self.owner, key, generation, ttl_ms,
                           self._margin, on_success, self.progress_within)
        if slot is not None:
            lease.resource, lease.slot = slot
        take_grant(lease, sent, answer)
        check_grant(lease, sent, self._margin)
        # A claim that waited long: renew once, now, as the thread client does.
        usable = lease.deadline - sent
        if lease.deadline - monotonic() < usable * 2 / 3:
            sent = monotonic()
            try:
                lease._set_grant(sent, await lease._renew(usable), first=True)
            except BaseException:
                give_back(lease)  # not renewed: not held for a known time
                raise
        if monotonic() >= lease.deadline:
            give_back(lease)
            raise ServerUnreachable(f"the lease on {job} was granted too late to be of use")
        lease._start()
        return lease

    async def status(self, job: str) -> Dict[str, Any]:
        """The job's lease record, as :meth:`fence_client.Client.status`."""
        path = f"/v1/leases/{encode_job(job)}"
        return await _in_thread(self._transport.call, "GET", path, then=await self._place())
